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

The synthesiser is espeak-ng's shared library and voice data from the `espeakng-loader` wheel (a
dependency of favor, so pip installs it on Linux and macOS; no system package, no root), called
through its C API with ctypes. If that package cannot be loaded, an `espeak-ng` program on PATH
is used instead (a log line says which); the two are different espeak-ng releases, so their audio
differs slightly. Voices are named as espeak-ng's voice files are, so both resolve them by name: "en"
is its British English voice (1.1.0 called it "en-gb", a language code the program looked up; there
"en-gb+m7" silently lost its variant and was the same voice as "en-gb", now "en+m7").

Configs: "default" (the corpus `configs/conformer_librispeech.py:data=local` trains on), "hard"
(`data=hard`: one or two phrases from a wider grammar, faster and slower speech, speed perturbation and
5-20 dB SNR, for a task that does not saturate), and "tiny" / "hard_tiny" (a handful of clips for
tests). Build: `python -m favor.data.local speech [--config hard]`.
"""

from __future__ import annotations

import ctypes
import _ctypes
import dataclasses
import io
import logging
import os
import shutil
import subprocess
import threading
import wave
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from favor import extras

tfds = extras.tfds("the espeak speech corpus (a TFDS builder)")

log = logging.getLogger(__name__)

SAMPLE_RATE = 16000
ESPEAK_RATE = 22050
# speakers are disjoint across splits, as in LibriSpeech: validation and test voices are never heard in training
SPLIT_VOICES = {
    "train": ("en-us", "en", "en-us+m3", "en+f2", "en-gb-scotland", "en-029", "en-us+f4", "en+m7",
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
# the "hard" corpus's wider grammar: supersets of the lists above, and questions
WIDE = {"actions": ACTIONS + ("GIVE", "SHOW", "DROP", "LIFT", "TURN", "PAINT", "CLEAN", "HIDE", "BRING", "CHECK"),
        "colours": COLOURS + ("ORANGE", "PURPLE", "BROWN", "GREY", "PINK", "SILVER"),
        "things": THINGS + ("TABLE", "WINDOW", "PHONE", "BOTTLE", "PLATE", "BAG", "CLOCK", "SHOE", "PEN", "CARD"),
        "places": PLACES + ("UNDER THE TABLE", "NEAR THE DOOR", "BEHIND THE CHAIR", "TWICE", "SLOWLY",
                            "INTO THE BAG", "ON THE SHELF")}


@dataclasses.dataclass
class FavorSpeechConfig(tfds.core.BuilderConfig):
    sizes: tuple = (4000, 300, 300)         # train, validation, test
    seed: int = 0
    phrases: tuple = (1, 1)                 # phrases an utterance strings together, inclusive range
    wide: bool = False                      # the wider grammar (WIDE, and questions)
    rates: tuple = RATES                    # words per minute
    snr_db: tuple = SNR_DB                  # white noise
    speed: tuple = (1.0, 1.0)               # speed perturbation: the clip plays this many times faster


# what makes the "hard" corpus (and its tests' "hard_tiny") harder than the default one
HARD = dict(phrases=(1, 2), wide=True, rates=(110, 250), snr_db=(5.0, 20.0), speed=(0.9, 1.1))


def sentence(rng: np.random.Generator, wide: bool = False) -> str:
    """A digit string or a command (wide: or a question), upper case (the transcript as LibriSpeech
    writes it)."""
    if rng.random() < 0.5:
        return " ".join(DIGITS[d] for d in rng.integers(0, 10, int(rng.integers(1, 8))))
    if not wide:
        words = [ACTIONS[rng.integers(len(ACTIONS))], "THE", COLOURS[rng.integers(len(COLOURS))],
                 THINGS[rng.integers(len(THINGS))], PLACES[rng.integers(len(PLACES))]]
        return " ".join(w for w in words if w)
    pick = {k: v[rng.integers(len(v))] for k, v in WIDE.items()}
    words = {0: [pick["actions"], "THE", pick["colours"], pick["things"], pick["places"]],
             1: ["WHERE IS THE", pick["colours"], pick["things"]],
             2: ["IS THE", pick["things"], pick["places"] or "HERE"]}[int(rng.integers(3))]
    return " ".join(w for w in words if w)


PACKAGE = "espeakng-loader"     # the PyPI wheel with espeak-ng's shared library and espeak-ng-data

# espeak-ng's C API (speak_lib.h)
AUDIO_OUTPUT_SYNCHRONOUS = 2    # the callback gets the audio before espeak_Synth returns, on the calling thread
INITIALIZE_DONT_EXIT = 0x8000   # without it a missing data directory exit()s the whole process
POS_CHARACTER = 1
CHARS_UTF8 = 1
ENDPAUSE = 0x1000               # the sentence pause at the end, as the espeak-ng program adds it
PARAM_RATE, PARAM_PITCH = 1, 3
EE_OK = 0
_SYNTH_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p)


class _Voice(ctypes.Structure):
    """espeak_VOICE, for espeak_SetVoiceByProperties (voices given as a language code)."""
    _fields_ = [("name", ctypes.c_char_p), ("languages", ctypes.c_char_p), ("identifier", ctypes.c_char_p),
                ("gender", ctypes.c_ubyte), ("age", ctypes.c_ubyte), ("variant", ctypes.c_ubyte),
                ("xx1", ctypes.c_ubyte), ("score", ctypes.c_int), ("spare", ctypes.c_void_p)]


class Library:
    """espeak-ng's shared library from the espeakng-loader wheel, driven through its C API.

    The library keeps synthesis state in C statics that outlive an utterance and even
    espeak_Terminate/espeak_Initialize (the pitch-flutter phase and the gain control, which nothing resets;
    and breath noise draws from libc's rand()): speaking the same text twice gives different samples, so the
    audio would depend on what was spoken before, and on the thread schedule. The espeak-ng program is
    reproducible only because each call is a fresh process. So each utterance maps the library afresh
    (dlclose + dlopen, then its first voice selection reads the voice and dictionary files again: small
    beside synthesis, BENCHMARKS.md design-measurements) and reseeds both random generators; a check at load time verifies this is enough.
    The library is one global state, not thread-safe: a lock serialises everything."""

    def __init__(self):
        try:
            import espeakng_loader    # the speech synthesiser loads when the speech corpus is built
            self.path = espeakng_loader.get_library_path()
            data = espeakng_loader.get_data_path()
        except Exception as e:      # not installed, or a build without its data (it raises RuntimeError)
            raise RuntimeError(f"favor_speech synthesises with espeak-ng's library from the {PACKAGE} package, "
                               f"which is not usable here ({type(e).__name__}: {e}); install it with "
                               f"`pip install {PACKAGE}`") from e
        self.root = os.path.dirname(data).encode()   # espeak_Initialize wants the directory holding espeak-ng-data
        self.lock = threading.Lock()
        self.lib = None
        self.chunks: list[bytes] = []
        self.callback = _SYNTH_CALLBACK(self._collect)   # referenced here so ctypes does not free the thunk
        self.libc = ctypes.CDLL(None) if os.name == "posix" else None    # the process's libc, for srand
        with self.lock:
            try:
                self._map()
                self.version = self.lib.espeak_Info(None).decode()
            except (OSError, AttributeError) as e:    # the .so failed to load, or lacks a function used here
                raise RuntimeError(f"espeak-ng's library from the {PACKAGE} package at {self.path} does not load: "
                                   f"{e}; reinstall it with `pip install --force-reinstall {PACKAGE}`") from e
        probe = ("ONE TWO", "en-us", 175, 50)        # with something else spoken in between: same samples?
        first = self.synthesize(*probe)
        self.synthesize("PUT THE RED BOX ON THE LEFT", "en+f2", 130, 70)
        if not np.array_equal(first, self.synthesize(*probe)):
            raise RuntimeError(f"espeak-ng's library from {PACKAGE} keeps state between utterances even when "
                               f"reloaded on this platform, so the corpus would not be reproducible")

    def _map(self):
        """Load the library (again: a fresh copy of its static state) and initialise it for synchronous
        output to our callback."""
        if self.lib is not None:
            self.lib.espeak_Terminate()
            handle, self.lib = self.lib._handle, None
            (_ctypes.dlclose if hasattr(_ctypes, "dlclose") else _ctypes.FreeLibrary)(handle)
        lib = ctypes.CDLL(self.path)
        lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        lib.espeak_SetSynthCallback.argtypes = [_SYNTH_CALLBACK]
        lib.espeak_SetSynthCallback.restype = None
        lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        lib.espeak_SetVoiceByProperties.argtypes = [ctypes.POINTER(_Voice)]
        lib.espeak_SetParameter.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.espeak_ng_SetRandSeed.argtypes = [ctypes.c_long]
        lib.espeak_ng_SetRandSeed.restype = ctypes.c_int
        lib.espeak_Synth.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint, ctypes.c_int, ctypes.c_uint,
                                     ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p]
        lib.espeak_Info.argtypes = [ctypes.POINTER(ctypes.c_char_p)]
        lib.espeak_Info.restype = ctypes.c_char_p
        rate = lib.espeak_Initialize(AUDIO_OUTPUT_SYNCHRONOUS, 0, self.root, INITIALIZE_DONT_EXIT)
        if rate != ESPEAK_RATE:
            raise RuntimeError(f"espeak-ng's library from {PACKAGE} did not initialise with its data in "
                               f"{self.root.decode()} (espeak_Initialize returned {rate}; expected {ESPEAK_RATE} Hz)")
        lib.espeak_SetSynthCallback(self.callback)
        self.lib = lib

    def _collect(self, wav, numsamples, events):
        if numsamples > 0:
            self.chunks.append(ctypes.string_at(wav, 2 * numsamples))
        return 0                # 0: go on synthesising

    def _set_voice(self, voice: str):
        if self.lib.espeak_SetVoiceByName(voice.encode()) == EE_OK:
            return
        # as the espeak-ng program does, a name that is no voice file may be a language code ("en-gb");
        # not with a +variant, which that lookup would silently drop
        if "+" not in voice and self.lib.espeak_SetVoiceByProperties(_Voice(languages=voice.encode())) == EE_OK:
            return
        raise ValueError(f"espeak-ng has no voice {voice!r}")

    def synthesize(self, text: str, voice: str, rate: int, pitch: int) -> np.ndarray:
        """The int16 waveform at ESPEAK_RATE; the same for the same arguments, whatever was spoken before."""
        with self.lock:
            self._map()
            self.lib.espeak_ng_SetRandSeed(1)       # espeak-ng's own generator
            if self.libc is not None:
                self.libc.srand(1)                  # and libc's, which a fresh process starts from
            self.chunks = []
            self._set_voice(voice)
            for param, value in ((PARAM_RATE, rate), (PARAM_PITCH, pitch)):
                if self.lib.espeak_SetParameter(param, int(value), 0) != EE_OK:
                    raise ValueError(f"espeak-ng rejected parameter {param} = {value}")
            data = text.encode()
            status = self.lib.espeak_Synth(data, len(data) + 1, 0, POS_CHARACTER, 0, CHARS_UTF8 | ENDPAUSE, None, None)
            self.lib.espeak_Synchronize()
            audio, self.chunks = b"".join(self.chunks), []
        if status != EE_OK or not audio:
            raise RuntimeError(f"espeak-ng's library failed for voice {voice!r} on {text!r} "
                               f"({'error ' + str(status) if status != EE_OK else 'no audio'})")
        return np.frombuffer(audio, np.int16)


_library: Library | None = None
_library_error: RuntimeError | None = None
_load_lock = threading.Lock()
_announced: set = set()


def load_library() -> Library:
    """The library, loaded once per process on first use; a RuntimeError naming the pip command if it
    cannot be (remembered: later calls raise it again without retrying)."""
    global _library, _library_error
    with _load_lock:
        if _library is None and _library_error is None:
            try:
                _library = Library()
            except RuntimeError as e:
                _library_error = e
        if _library_error is not None:
            raise RuntimeError(str(_library_error)) from _library_error
        return _library


def choose_engine() -> str | None:
    """What synthesises by default: None for espeak-ng's library (from the espeakng-loader package), else
    the path of an `espeak-ng` program on PATH, used when the library cannot be loaded. Logged once each."""
    try:
        library = load_library()
        choice, line = None, f"espeak-ng {library.version} library from {PACKAGE} ({library.path})"
    except RuntimeError as e:
        path = shutil.which("espeak-ng")
        if path is None:
            raise RuntimeError(f"favor_speech needs espeak-ng and has neither its library nor a program: {e} "
                               f"(or put an `espeak-ng` program on PATH)") from e
        choice, line = path, f"the espeak-ng program at {path}, since the library cannot be used: {e}"
    if line not in _announced:
        _announced.add(line)
        log.info("favor_speech synthesises with %s", line)
    return choice


def synthesize(text: str, voice: str, rate: int, pitch: int, binary: str | None = None) -> np.ndarray:
    """espeak-ng's waveform for `text` as float32 at its native 22.05 kHz. `binary`: an espeak-ng program to
    run; None (the default) is the library, or the program on PATH when the library cannot be loaded."""
    if binary is None:
        binary = choose_engine()
    if binary is None:
        return load_library().synthesize(text, voice, rate, pitch).astype(np.float32) / 32768.0
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
    speed: float = 1.0


def draw(seed: int, split: str, index: int, config: FavorSpeechConfig | None = None) -> Draw:
    """The draws of example `index` of `split` in corpus `config` (default: "default"): a pure function of
    (config, seed, split, index). The default corpus's draws come first and in their order, so a config's
    new options never change them."""
    c = config or FavorSpeechConfig(name="default")
    rng = np.random.default_rng([seed, SPLITS.index(split), index])
    voices = SPLIT_VOICES[split]
    lo, hi = c.phrases
    text = " ".join(sentence(rng, c.wide) for _ in range(lo if lo == hi else int(rng.integers(lo, hi + 1))))
    d = Draw(text=text, speaker=VOICES.index(voices[rng.integers(len(voices))]),
             rate=int(rng.integers(c.rates[0], c.rates[1] + 1)), pitch=int(rng.integers(PITCH[0], PITCH[1] + 1)),
             level=float(rng.uniform(0.1, 0.9)), snr_db=float(rng.uniform(*c.snr_db)),
             noise_seed=int(rng.integers(1 << 31)))
    if c.speed[0] != c.speed[1]:
        d = dataclasses.replace(d, speed=float(rng.uniform(*c.speed)))
    return d


def utterance(seed: int, split: str, index: int, binary: str | None = None,
              config: FavorSpeechConfig | None = None) -> dict:
    """Example `index` of `split` (a TFDS example dict), deterministic in (config, seed, split, index).
    `binary`: as for `synthesize`."""
    from scipy.signal import resample_poly    # scipy's submodules load on use
    d = draw(seed, split, index, config)
    # 22.05 -> 16 kHz (320/441); a speed s > 1 resamples to 16000/s instead (Kaldi's speed perturbation:
    # faster and higher, like a tape played fast), the ratio rounded to 320 / round(441·s)
    x = resample_poly(synthesize(d.text, VOICES[d.speaker], d.rate, d.pitch, binary), 320, round(441 * d.speed))
    x = x / max(np.max(np.abs(x)), 1e-6) * d.level
    noise = np.random.default_rng(d.noise_seed).standard_normal(len(x))
    x = x + noise * np.sqrt(np.mean(x ** 2) / 10 ** (d.snr_db / 10))
    pcm = np.clip(np.round(x * 32767), -32768, 32767).astype(np.int16)
    return {"speech": pcm, "text": d.text, "speaker_id": d.speaker, "chapter_id": d.rate,
            "id": f"{d.speaker}-{d.rate}-{index:06d}"}


class FavorSpeech(tfds.core.GeneratorBasedBuilder):
    """Digit strings and short commands spoken by espeak-ng voices, 16 kHz, LibriSpeech's features."""

    VERSION = tfds.core.Version("1.3.0")
    RELEASE_NOTES = {"1.0.0": "Digit strings and commands; 10 voices, 130-215 wpm, 30-50 dB SNR.",
                     "1.1.0": "Speakers disjoint across splits: 10 training voices, 2 validation, 2 test.",
                     "1.2.0": "espeak-ng 1.52's library from the espeakng-loader wheel instead of the system "
                              "program; 'en-gb+m7' (which was 'en-gb') is now 'en+m7', 'en-gb' is named 'en'.",
                     "1.3.0": "'speech' is a plain int16 tensor (the same samples): reading the corpus no longer "
                              "loads TensorFlow."}
    BUILDER_CONFIGS = [
        FavorSpeechConfig(name="default", description="4000 / 300 / 300 utterances (train / validation / test)."),
        FavorSpeechConfig(name="tiny", description="8 / 4 / 4 utterances, for tests.", sizes=(8, 4, 4)),
        FavorSpeechConfig(name="hard", description="4000 / 300 / 300 utterances of one or two phrases from a "
                          "wider grammar (76 words), 110-250 words a minute, speed 0.9-1.1, 5-20 dB SNR.", **HARD),
        FavorSpeechConfig(name="hard_tiny", description="8 / 4 / 4 utterances of the hard corpus, for tests.",
                          sizes=(8, 4, 4), **HARD),
    ]

    def _info(self):
        return self.dataset_info_from_configs(
            features=tfds.features.FeaturesDict({
                # LibriSpeech's samples (16 kHz int16, the rate in the metadata) as a plain tensor: tfds'
                # Audio feature needs TensorFlow, a slow import in every run that reads the corpus
                "speech": tfds.features.Tensor(shape=(None,), dtype=np.int16),
                "text": tfds.features.Text(),
                "speaker_id": np.int64,
                "chapter_id": np.int64,
                "id": tfds.features.Text(),
            }),
            supervised_keys=("speech", "text"),
            homepage="https://github.com/espeak-ng/espeak-ng",
            metadata=tfds.core.MetadataDict(sample_rate=SAMPLE_RATE, voices=list(VOICES)))

    def _split_generators(self, dl_manager):
        binary = choose_engine()       # None: the library; else the espeak-ng program (logged)
        sizes = dict(zip(SPLITS, self.builder_config.sizes))
        return {split: self._generate_examples(split, sizes[split], binary) for split in SPLITS}

    def _generate_examples(self, split, size, binary):
        # the library serialises synthesis (one lock; ctypes releases the GIL while it runs), the other threads
        # resample and add noise meanwhile; the program fallback runs one subprocess per thread
        seed = self.builder_config.seed
        with ThreadPoolExecutor(max_workers=max(os.cpu_count() or 1, 2)) as pool:
            config = self.builder_config
            for i, ex in enumerate(pool.map(lambda i: utterance(seed, split, i, binary, config), range(size))):
                yield i, ex
