"""`favor_speech`: spoken English synthesised offline with espeak-ng, shaped like TFDS `librispeech`.

Features as `librispeech`: {"speech": int16 audio at 16 kHz, "text": the transcript in upper-case
words, "speaker_id": the voice (index into VOICES), "chapter_id": the speaking rate in words per
minute, "id": "<speaker>-<rate>-<index>"}. So `favor.data.speech.Speech` reads it with the same code
as LibriSpeech (`data.dataset = "local"`).

Each utterance is either a digit string ("THREE SEVEN ONE NINE", 1-7 digits) or a short command from a
small grammar ("PUT THE RED BOX ON THE LEFT"), spoken by one of several voices (accents × voice
variants) at a random rate and pitch, resampled from espeak-ng's 22.05 kHz to 16 kHz
(scipy.signal.resample_poly, 320/441), scaled to a random level and mixed with white noise at 30-50 dB
SNR (so silence is not digital zero). Everything is drawn from a generator seeded by (config seed,
split, index): building twice gives the same corpus. As in LibriSpeech, speakers are disjoint across
splits: 10 voices train, 2 others are the validation set's and 2 more the test set's, so evaluation
measures recognition of voices never heard in training.

Configs: "default" (the corpus `configs/conformer_librispeech.py:data=local` trains on) and "tiny"
(a handful of clips for tests). Build: `python -m favor.data.local speech` (needs `espeak-ng` on PATH).
"""

from __future__ import annotations

import dataclasses
import io
import os
import shutil
import subprocess
import wave
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import tensorflow_datasets as tfds

SAMPLE_RATE = 16000
ESPEAK_RATE = 22050
# speakers are disjoint across splits, as in LibriSpeech: validation and test voices are never heard in training
SPLIT_VOICES = {
    "train": ("en-us", "en-gb", "en-us+m3", "en+f2", "en-gb-scotland", "en-029", "en-us+f4", "en-gb+m7",
              "en-gb-x-gbclan", "en-us+m1"),
    "validation": ("en-gb-x-rp", "en+f5"),
    "test": ("en-us+m5", "en-gb-x-gbcwmd"),
}
SPLITS = tuple(SPLIT_VOICES)
VOICES = tuple(v for split in SPLITS for v in SPLIT_VOICES[split])     # speaker_id indexes this
RATES = (130, 215)          # words per minute, uniform (espeak-ng's default is 175)
PITCH = (25, 75)            # espeak-ng -p, 0-99 (default 50)
SNR_DB = (30.0, 50.0)
DIGITS = ("ZERO", "ONE", "TWO", "THREE", "FOUR", "FIVE", "SIX", "SEVEN", "EIGHT", "NINE")
ACTIONS = ("MOVE", "PUT", "TAKE", "FIND", "OPEN", "CLOSE", "PUSH", "PULL")
COLOURS = ("RED", "GREEN", "BLUE", "YELLOW", "BLACK", "WHITE")
THINGS = ("BOX", "BALL", "DOOR", "CUP", "BOOK", "CHAIR", "LAMP", "KEY")
PLACES = ("", "UP", "DOWN", "ON THE LEFT", "ON THE RIGHT", "NOW", "AGAIN")


@dataclasses.dataclass
class FavorSpeechConfig(tfds.core.BuilderConfig):
    sizes: tuple = (4000, 300, 300)         # train, validation, test
    seed: int = 0


def sentence(rng: np.random.Generator) -> str:
    """A digit string or a command, upper case (the transcript as LibriSpeech writes it)."""
    if rng.random() < 0.5:
        return " ".join(DIGITS[d] for d in rng.integers(0, 10, int(rng.integers(1, 8))))
    words = [ACTIONS[rng.integers(len(ACTIONS))], "THE", COLOURS[rng.integers(len(COLOURS))],
             THINGS[rng.integers(len(THINGS))], PLACES[rng.integers(len(PLACES))]]
    return " ".join(w for w in words if w)


def espeak_binary() -> str:
    path = shutil.which("espeak-ng")
    if path is None:
        raise RuntimeError("favor_speech needs the espeak-ng speech synthesiser, which is not on PATH; install it "
                           "with `apt-get install espeak-ng` (Debian/Ubuntu) or `brew install espeak-ng` (macOS)")
    return path


def synthesize(text: str, voice: str, rate: int, pitch: int, binary: str = "espeak-ng") -> np.ndarray:
    """espeak-ng's waveform for `text` as float32 at its native 22.05 kHz."""
    out = subprocess.run([binary, "-v", voice, "-s", str(rate), "-p", str(pitch), "--stdout", text],
                         capture_output=True, check=False)
    if out.returncode != 0 or len(out.stdout) <= 44:
        raise RuntimeError(f"espeak-ng failed for voice {voice!r} on {text!r}: "
                           f"{out.stderr.decode(errors='replace').strip() or 'no audio'}")
    with wave.open(io.BytesIO(out.stdout)) as w:   # --stdout streams: the header's length is a placeholder
        if (w.getframerate(), w.getnchannels(), w.getsampwidth()) != (ESPEAK_RATE, 1, 2):
            raise RuntimeError(f"espeak-ng gave {w.getframerate()} Hz × {w.getnchannels()} channels × "
                               f"{8 * w.getsampwidth()} bits; expected {ESPEAK_RATE} Hz mono 16-bit")
        pcm = np.frombuffer(w.readframes(w.getnframes()), np.int16)
    return pcm.astype(np.float32) / 32768.0


@dataclasses.dataclass(frozen=True)
class Draw:
    """Everything random about one utterance."""
    text: str
    speaker: int          # index into VOICES
    rate: int             # words per minute
    pitch: int
    level: float          # peak amplitude, full scale = 1
    snr_db: float
    noise_seed: int


def draw(seed: int, split: str, index: int) -> Draw:
    """The draws of example `index` of `split`: a pure function of (seed, split, index)."""
    rng = np.random.default_rng([seed, SPLITS.index(split), index])
    voices = SPLIT_VOICES[split]
    return Draw(text=sentence(rng), speaker=VOICES.index(voices[rng.integers(len(voices))]),
                rate=int(rng.integers(RATES[0], RATES[1] + 1)), pitch=int(rng.integers(PITCH[0], PITCH[1] + 1)),
                level=float(rng.uniform(0.1, 0.9)), snr_db=float(rng.uniform(*SNR_DB)),
                noise_seed=int(rng.integers(1 << 31)))


def utterance(seed: int, split: str, index: int, binary: str = "espeak-ng") -> dict:
    """Example `index` of `split` (a TFDS example dict), deterministic in (seed, split, index)."""
    from scipy.signal import resample_poly
    d = draw(seed, split, index)
    x = resample_poly(synthesize(d.text, VOICES[d.speaker], d.rate, d.pitch, binary), 320, 441)  # ×16000/22050
    x = x / max(np.max(np.abs(x)), 1e-6) * d.level
    noise = np.random.default_rng(d.noise_seed).standard_normal(len(x))
    x = x + noise * np.sqrt(np.mean(x ** 2) / 10 ** (d.snr_db / 10))
    pcm = np.clip(np.round(x * 32767), -32768, 32767).astype(np.int16)
    return {"speech": pcm, "text": d.text, "speaker_id": d.speaker, "chapter_id": d.rate,
            "id": f"{d.speaker}-{d.rate}-{index:06d}"}


class FavorSpeech(tfds.core.GeneratorBasedBuilder):
    """Digit strings and short commands spoken by espeak-ng voices, 16 kHz, LibriSpeech's features."""

    VERSION = tfds.core.Version("1.1.0")
    RELEASE_NOTES = {"1.0.0": "Digit strings and commands; 10 voices, 130-215 wpm, 30-50 dB SNR.",
                     "1.1.0": "Speakers disjoint across splits: 10 training voices, 2 validation, 2 test."}
    BUILDER_CONFIGS = [
        FavorSpeechConfig(name="default", description="4000 / 300 / 300 utterances (train / validation / test)."),
        FavorSpeechConfig(name="tiny", description="8 / 4 / 4 utterances, for tests.", sizes=(8, 4, 4)),
    ]

    def _info(self):
        return self.dataset_info_from_configs(
            features=tfds.features.FeaturesDict({
                "speech": tfds.features.Audio(dtype=np.int16, sample_rate=SAMPLE_RATE),
                "text": tfds.features.Text(),
                "speaker_id": np.int64,
                "chapter_id": np.int64,
                "id": tfds.features.Text(),
            }),
            supervised_keys=("speech", "text"),
            homepage="https://github.com/espeak-ng/espeak-ng",
            metadata=tfds.core.MetadataDict(sample_rate=SAMPLE_RATE, voices=list(VOICES)))

    def _split_generators(self, dl_manager):
        binary = espeak_binary()
        sizes = dict(zip(SPLITS, self.builder_config.sizes))
        return {split: self._generate_examples(split, sizes[split], binary) for split in SPLITS}

    def _generate_examples(self, split, size, binary):
        # espeak-ng runs as a subprocess: threads overlap the synthesis (the GIL is released while waiting)
        seed = self.builder_config.seed
        with ThreadPoolExecutor(max_workers=max(os.cpu_count() or 1, 2)) as pool:
            for i, ex in enumerate(pool.map(lambda i: utterance(seed, split, i, binary), range(size))):
                yield i, ex
