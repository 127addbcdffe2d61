"""Speech: log-mel features, SpecAugment, CTC loss / decoding / WER, the LibriSpeech pipeline on TFDS mock
data, and the espeak-ng corpus."""

import itertools
import math
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import tensorflow_datasets as tfds
from flax import nnx

from favor import data, job
from favor.data import audio, speech
from favor.tasks import ctc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from configs import conformer_librispeech  # noqa: E402


# -- features ------------------------------------------------------------------------------------------
def numpy_log_mel(wave):
    """Independent reference: framing, periodic Hann, rfft, HTK-mel triangles (mel = 1127 ln(1 + f/700))
    built in the mel domain over the non-DC bins, log with the same floor."""
    x = np.asarray(wave, np.float64)
    frames = -(-len(x) // audio.HOP)
    x = np.pad(x, (0, (frames - 1) * audio.HOP + audio.WINDOW - len(x)))
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(audio.WINDOW) / audio.WINDOW)
    spec = np.stack([np.abs(np.fft.rfft(x[i * audio.HOP:i * audio.HOP + audio.WINDOW] * window, audio.FFT)) ** 2
                     for i in range(frames)])
    mel = lambda f: 1127.0 * np.log1p(np.asarray(f) / 700.0)
    hz = np.linspace(0, audio.SAMPLE_RATE / 2, audio.FFT // 2 + 1)[1:]
    edges = np.linspace(mel(audio.LOWER_HZ), mel(audio.UPPER_HZ), audio.NUM_MELS + 2)
    lo, mid, hi = edges[:-2], edges[1:-1], edges[2:]
    m = mel(hz)[:, None]
    weights = np.maximum(0, np.minimum((m - lo) / (mid - lo), (hi - m) / (hi - mid)))
    weights = np.concatenate([np.zeros((1, audio.NUM_MELS)), weights])          # DC bin: no weight
    return np.log(np.maximum(spec @ weights, audio.LOG_FLOOR))


def test_log_mel_matches_an_independent_numpy_computation():
    rng = np.random.default_rng(0)
    waves = [rng.uniform(-0.5, 0.5, n).astype(np.float32) for n in (4000, 2345)]
    feats, lengths = audio.log_mel(waves)
    assert feats.shape == (2, 25, 80) and lengths.tolist() == [25, 15]
    for f, n, w in zip(feats, lengths, waves):
        ref = numpy_log_mel(w)
        # float32 STFT vs float64: relative power error ~1e-6 · log2(FFT); 1e-3 in log power is 100× that
        np.testing.assert_allclose(f[:n], ref, atol=1e-3)
        assert np.all(f[n:] == 0)


def test_log_mel_matches_tensorflows_signal_ops():
    """The front end computes what TensorFlow's STFT and mel filterbank give (the usual ASR front end)."""
    import tensorflow as tf
    for rate in (16000, 8000):
        ref = tf.signal.linear_to_mel_weight_matrix(audio.NUM_MELS, audio.FFT // 2 + 1, rate, audio.LOWER_HZ,
                                                    min(audio.UPPER_HZ, rate / 2)).numpy()
        # TensorFlow builds the triangles in float32: mels near 2800 carry 2.4e-4 of rounding, over bands
        # ~35 mels wide that is ~1e-5 of a weight
        np.testing.assert_allclose(audio.mel_matrix(audio.NUM_MELS, rate), ref, atol=5e-5)
    rng = np.random.default_rng(1)
    waves = [rng.uniform(-0.5, 0.5, n).astype(np.float32) for n in (3999, 160, 1)]
    feats, lengths = audio.log_mel(waves)
    x = np.zeros((3, 3999), np.float32)
    for i, w in enumerate(waves):
        x[i, :len(w)] = w
    stft = tf.signal.stft(x, audio.WINDOW, audio.HOP, audio.FFT, window_fn=tf.signal.hann_window, pad_end=True)
    ref = np.log(np.maximum(np.square(np.abs(stft.numpy())) @ audio.mel_matrix(), audio.LOG_FLOOR))
    for f, r, n in zip(feats, ref, lengths):
        np.testing.assert_allclose(f[:n], r[:n], atol=1e-3)


def test_a_pure_tone_lands_in_the_mel_bin_centred_on_it():
    mel = lambda f: 1127.0 * np.log1p(f / 700.0)
    centres = np.linspace(mel(audio.LOWER_HZ), mel(audio.UPPER_HZ), audio.NUM_MELS + 2)[1:-1]
    t = np.arange(audio.SAMPLE_RATE) / audio.SAMPLE_RATE
    for hz in (1000.0, 2000.0, 4000.0, 6000.0):           # on the FFT grid (31.25 Hz): no leakage
        feats, _ = audio.log_mel([0.5 * np.sin(2 * np.pi * hz * t)])
        energy = feats[0, 2:-2].mean(0)                   # frames away from the clip's edges
        k = int(np.argmin(np.abs(centres - mel(hz))))
        assert int(np.argmax(energy)) == k, (hz, int(np.argmax(energy)), k)
        far = np.abs(np.arange(audio.NUM_MELS) - k) > 3
        assert energy[k] - energy[far].max() > np.log(1e3)     # ≥ 30 dB above the filters 4+ away


def test_frame_counts_and_int16_input():
    pcm = [np.zeros(n, np.int16) for n in (1, 160, 161, 16000)]
    feats, lengths = audio.log_mel(pcm)
    assert lengths.tolist() == [1, 1, 2, 100] and feats.shape == (4, 100, 80)
    np.testing.assert_allclose(feats[0, 0], np.log(audio.LOG_FLOOR))   # silence: the floor
    with pytest.raises(ValueError, match="int16"):
        audio.log_mel([np.zeros(10, np.int32)])
    with pytest.raises(ValueError, match="16000 Hz"):
        audio.log_mel([np.zeros(10)], sample_rate=8000)


def test_normalize_gives_zero_mean_unit_variance_over_valid_frames():
    rng = np.random.default_rng(1)
    x = rng.normal(3.0, 2.0, (2, 50, 80)).astype(np.float32)
    out = audio.normalize(x, np.array([50, 20]))
    for row, n in zip(out, (50, 20)):
        np.testing.assert_allclose(row[:n].mean(0), 0, atol=1e-5)
        np.testing.assert_allclose(row[:n].std(0), 1, atol=1e-3)       # var / (var + 1e-5) with var ≈ 4
        assert np.all(row[n:] == 0)


# -- SpecAugment ---------------------------------------------------------------------------------------
def runs(mask):
    """Lengths of the runs of True."""
    return [len(list(g)) for v, g in itertools.groupby(mask) if v]


def test_spec_augment_masks_stay_within_the_policy():
    p = audio.LIBRISPEECH
    assert (p.freq_masks, p.freq_width, p.time_masks, p.time_ratio) == (2, 27, 10, 0.05)
    widest_f, widest_t = 0, 0
    for seed in range(300):
        length = 50 + 7 * seed
        time, freq = audio.spec_augment_masks(length, 80, np.random.default_rng(seed))
        assert len(runs(freq)) <= 2 and freq.sum() <= 2 * 27
        assert len(runs(time)) <= 10 and time.sum() <= 10 * math.floor(0.05 * length)
        one_t, one_f = audio.spec_augment_masks(length, 80, np.random.default_rng(seed),
                                                audio.SpecAugmentPolicy(freq_masks=1, time_masks=1))
        assert one_f.sum() <= 27 and one_t.sum() <= math.floor(0.05 * length)
        widest_f, widest_t = max(widest_f, one_f.sum()), max(widest_t, one_t.sum() / math.floor(0.05 * length))
    assert widest_f == 27 and widest_t == 1.0          # the limits are reached, not just respected


def test_spec_augment_is_deterministic_in_the_rng_and_zeroes_the_masks():
    x = np.random.default_rng(0).standard_normal((300, 80)).astype(np.float32) + 5
    a = audio.spec_augment(x, np.random.default_rng(7))
    np.testing.assert_array_equal(a, audio.spec_augment(x, np.random.default_rng(7)))
    assert not np.array_equal(a, audio.spec_augment(x, np.random.default_rng(8)))
    time, freq = audio.spec_augment_masks(300, 80, np.random.default_rng(7))
    masked = time[:, None] | freq[None, :]
    assert masked.any() and np.all(a[masked] == 0) and np.array_equal(a[~masked], x[~masked])


# -- CTC -----------------------------------------------------------------------------------------------
def test_greedy_decoding_collapses_repeats_and_drops_blanks():
    frames = [0, 3, 3, 0, 3, 4, 4, 0, 0, 5, 9]           # class k is sentencepiece id k − 1; 0 = blank
    assert ctc.greedy_decode(frames, 10) == [2, 2, 3, 4]   # the frame past the length is ignored
    assert ctc.greedy_decode([0, 0, 0], 3) == [] and ctc.greedy_decode([1, 2], 0) == []


def test_error_rates_match_hand_counts():
    # S (CAT->BAT) + D (ON) + I (MAT) = 3 errors over 6 words; the first pair is exact
    refs = ["THE CAT SAT", "THE CAT SAT ON THE MAT"]
    hyps = ["THE CAT SAT", "THE BAT SAT THE MAT MAT"]
    assert ctc.error_rates(refs[1:], hyps[1:])["wer"] == pytest.approx(3 / 6)
    assert ctc.error_rates(refs, hyps)["wer"] == pytest.approx(3 / 9)     # corpus: errors / reference words
    assert ctc.error_rates(["A"], ["A B C"])["wer"] == pytest.approx(2.0)  # insertions can exceed 100 %
    assert ctc.error_rates(["ONE TWO"], [""])["wer"] == pytest.approx(1.0)
    assert ctc.error_rates(["ABC"], ["ABD"])["cer"] == pytest.approx(1 / 3)
    assert ctc.error_rates(["", "X Y"], ["Z", "X Y"])["wer"] == 0.0      # empty references are skipped


def test_ctc_loss_with_our_paddings_is_the_sum_over_alignments():
    """−log Σ over every frame path that collapses to the labels, by enumeration: checks the blank
    (class 0), the id → class k + 1 shift and both paddings."""
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((2, 5, 4)).astype(np.float32)      # 3 sentencepiece ids + blank
    frames = np.array([4, 3])                                       # valid encoder frames
    ids = np.array([[1, 1, 0], [2, 0, 0]])                          # a repeat (needs a blank between); padding
    lengths = np.array([2, 1])
    labels, label_paddings = ctc.ctc_inputs(ids, lengths)
    logit_paddings = (np.arange(5)[None] >= frames[:, None]).astype(np.float32)
    got = optax.ctc_loss(jnp.asarray(logits), jnp.asarray(logit_paddings), labels, label_paddings)
    for b in range(2):
        logp = jax.nn.log_softmax(logits[b, :frames[b]].astype(np.float64), -1)
        target = [i + 1 for i in ids[b, :lengths[b]]]
        total = 0.0
        for path in itertools.product(range(4), repeat=int(frames[b])):
            collapsed = [c for j, c in enumerate(path) if c != 0 and (j == 0 or c != path[j - 1])]
            if collapsed == target:
                total += np.exp(sum(float(logp[t, c]) for t, c in enumerate(path)))
        np.testing.assert_allclose(float(got[b]), -np.log(total), rtol=1e-5)
    # a repeated label needs a blank between: 2 frames cannot align [1, 1], 3 can
    assert ctc.alignable(ids[:1], lengths[:1], np.array([2])).tolist() == [False]
    assert ctc.alignable(ids[:1], lengths[:1], np.array([3])).tolist() == [True]
    assert ctc.alignable(ids[1:], np.array([0]), np.array([5])).tolist() == [False]   # no labels: left out


# -- pipelines -----------------------------------------------------------------------------------------
def test_librispeech_runlocal_trains_and_reports_wer(tmp_path):
    config = conformer_librispeech.get_config("runlocal")
    config.data.data_dir = str(tmp_path)        # the tokenizer trained on the mock text is cached here
    with tfds.testing.mock_data(num_examples=24, policy=tfds.testing.MockPolicy.USE_CODE):
        summary = job.run(config, tmp_path / "run")
    assert summary["step"] == config.total_steps
    assert {"wer", "cer", "loss"} <= set(summary)
    assert np.isfinite(summary["wer"]) and np.isfinite(summary["cer"]) and np.isfinite(summary["train_loss"])
    assert list((tmp_path / "favor_tokenizers").glob("librispeech-*-n24-v32.model"))


@pytest.fixture(scope="module")
def tiny_corpus(tmp_path_factory):
    # built as on a fresh machine: no espeak-ng program, only the library the espeakng-loader dependency ships
    # (no skip: if it cannot load, the builder's error names the pip command)
    import favor.data.espeak  # noqa: F401  (registers favor_speech)
    root = tmp_path_factory.mktemp("tfds")
    builder = tfds.builder("favor_speech/tiny", data_dir=str(root), file_format="array_record")
    with pytest.MonkeyPatch.context() as mp:
        hide_espeak_program(mp, tmp_path_factory.mktemp("empty_path"))
        builder.download_and_prepare()
    return builder, root


def hide_espeak_program(monkeypatch, empty_dir):
    from favor.data import espeak
    monkeypatch.setenv("PATH", str(empty_dir))
    monkeypatch.setattr(espeak.shutil, "which", lambda name: None)

    def no_subprocess(*args, **kwargs):
        raise AssertionError(f"ran a program: {args}")
    monkeypatch.setattr(espeak.subprocess, "run", no_subprocess)


def loud_to_quiet(x):
    """Loudest over quietest 10 ms frames (RMS) of 22.05 kHz audio: speech with pauses, not noise or silence."""
    frames = x[:len(x) // 220 * 220].reshape(-1, 220).astype(np.float64)
    rms = np.sort(np.sqrt(np.mean(frames ** 2, 1)))
    return rms[-5:].mean() / max(rms[:5].mean(), 1e-9)


def test_espeak_library_speaks_without_the_espeak_program(tmp_path, monkeypatch):
    from favor.data import espeak
    hide_espeak_program(monkeypatch, tmp_path)
    assert espeak.choose_engine() is None                    # the library, from the espeakng-loader package
    library = espeak.load_library()
    assert library.version.startswith("1.") and library.lib.espeak_ng_GetSampleRate() == espeak.ESPEAK_RATE == 22050
    short = espeak.synthesize("ONE TWO", "en-us", 175, 50)
    long = espeak.synthesize("ONE TWO THREE FOUR FIVE SIX SEVEN", "en-us", 175, 50)
    fast = espeak.synthesize("ONE TWO THREE FOUR FIVE SIX SEVEN", "en-us", 350, 50)
    for x in (short, long, fast):
        assert x.dtype == np.float32 and 0.05 < np.abs(x).max() <= 1 and loud_to_quiet(x) > 100
    # 22.05 kHz: about 2.5 words a second at 175 wpm (espeak's rate counts pauses too); length follows the
    # text, and the rate shortens it
    assert 0.5 * 22050 < len(short) < 1.5 * 22050 and 2 * 22050 < len(long) < 4.5 * 22050
    assert 2.5 < len(long) / len(short) < 5 and 1.5 < len(long) / len(fast) < 2.5
    # a pure function: the same samples after other voices have spoken (the library is reloaded per utterance)
    espeak.synthesize("PUT THE RED BOX ON THE LEFT", "en+f2", 130, 70)
    np.testing.assert_array_equal(espeak.synthesize("ONE TWO", "en-us", 175, 50), short)
    # every voice of the corpus exists in the packaged data and sounds different (a variant the library
    # silently ignored would repeat its base voice: 1.1.0's "en-gb+m7" was "en-gb")
    clips = {v: espeak.synthesize("PUT THE RED BOX ON THE LEFT", v, 175, 50) for v in espeak.VOICES}
    assert len({x.tobytes() for x in clips.values()}) == len(espeak.VOICES) == 14
    with pytest.raises(ValueError, match="no voice 'xx-nope'"):
        espeak.synthesize("ONE", "xx-nope", 175, 50)
    ex = espeak.utterance(0, "validation", 1)
    assert ex["speech"].dtype == np.int16 and len(ex["speech"]) > 0.3 * 16000


def test_espeak_library_and_program_give_speech_of_the_same_duration():
    from favor.data import espeak
    program = shutil.which("espeak-ng")
    for index in range(6):
        d = espeak.draw(0, "train", index)
        voice = espeak.VOICES[d.speaker]
        lib = espeak.synthesize(d.text, voice, d.rate, d.pitch, binary=None)
        words = len(d.text.split())
        # espeak-ng's rate is words a minute: the clip lasts about words / rate minutes, plus the end pause
        assert 0.5 < (len(lib) / 22050) / (60 * words / d.rate + 0.4) < 2.0, (d, len(lib))
        assert loud_to_quiet(lib) > 100
        if program is not None:      # the fallback (a different espeak-ng release) agrees within a few %
            prog = espeak.synthesize(d.text, voice, d.rate, d.pitch, binary=program)
            assert abs(len(lib) - len(prog)) < 0.05 * len(prog), (d, len(lib), len(prog))


def test_espeak_without_its_library_names_the_pip_command_or_falls_back_to_the_program(monkeypatch):
    from favor.data import espeak
    monkeypatch.setattr(espeak, "_library", None)
    monkeypatch.setattr(espeak, "_library_error", None)
    monkeypatch.setitem(sys.modules, "espeakng_loader", None)      # `import espeakng_loader` fails
    monkeypatch.setattr(espeak.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match=r"espeakng-loader.*`pip install espeakng-loader`"):
        espeak.choose_engine()
    with pytest.raises(RuntimeError, match=r"`pip install espeakng-loader`"):
        espeak.synthesize("ONE", "en-us", 175, 50)
    monkeypatch.setattr(espeak.shutil, "which", lambda name: "/opt/bin/espeak-ng" if name == "espeak-ng" else None)
    assert espeak.choose_engine() == "/opt/bin/espeak-ng"


def test_espeak_corpus_has_real_16khz_speech_with_transcripts(tiny_corpus):
    from favor.data import espeak
    builder, _ = tiny_corpus
    assert builder.info.metadata["sample_rate"] == 16000
    assert builder.info.features["speech"].dtype == np.int16
    source = builder.as_data_source(split="train")
    assert len(source) == 8
    words = set(espeak.DIGITS + espeak.ACTIONS + espeak.COLOURS + espeak.THINGS + ("THE", "UP", "DOWN", "ON", "LEFT",
                                                                                    "RIGHT", "NOW", "AGAIN"))
    for i in range(len(source)):
        ex = source[i]
        text = speech._text(ex["text"])
        assert text and text == text.upper() and set(text.split()) <= words
        pcm = np.asarray(ex["speech"])
        assert pcm.dtype == np.int16 and 0.3 * 16000 < len(pcm) < 10 * 16000
        # speech, not noise: the loudest 10 ms frames are far above the quietest (30-50 dB SNR)
        frames = pcm[:len(pcm) // 160 * 160].reshape(-1, 160).astype(np.float64)
        rms = np.sort(np.sqrt(np.mean(frames ** 2, 1)))
        assert rms[-5:].mean() > 10 * rms[:5].mean()
    # speakers disjoint across splits (LibriSpeech's convention): evaluation voices are never trained on
    speakers = {split: {int(ex["speaker_id"]) for ex in builder.as_data_source(split=split)}
                for split in espeak.SPLITS}
    for split, ids in speakers.items():
        assert {espeak.VOICES[i] for i in ids} <= set(espeak.SPLIT_VOICES[split])
    assert not speakers["train"] & (speakers["validation"] | speakers["test"])
    # deterministic, and resampled 22.05 -> 16 kHz: the duration is espeak's
    a, b = espeak.utterance(0, "train", 3), espeak.utterance(0, "train", 3)
    np.testing.assert_array_equal(a["speech"], b["speech"])
    d = espeak.draw(0, "train", 3)
    native = espeak.synthesize(d.text, espeak.VOICES[d.speaker], d.rate, d.pitch)
    assert len(a["speech"]) == math.ceil(len(native) * 16000 / 22050) and a["text"] == d.text


READS_WITHOUT_TENSORFLOW = """
import sys
from favor import data
src = data.get({"name": "speech", "dataset": "local:tiny", "data_dir": sys.argv[1], "train_split": "train",
                "eval_split": "validation", "vocab_size": 48, "max_frames": 400, "buckets": (400,)})
batch = next(src.train_batches(4, 0, 0))
assert batch["features"].shape[:2] == (4, 400)
loaded = sorted(m for m in sys.modules if m == "tensorflow" or m.startswith("tensorflow.python"))
assert not loaded, loaded[:5]
"""


def test_the_espeak_corpus_is_read_without_tensorflow(tiny_corpus):
    """A speech run on the local corpus (its tokenizer trained, a batch read) never imports TensorFlow:
    the corpus stores its samples as a plain tensor, not tfds' Audio feature."""
    _, root = tiny_corpus
    done = subprocess.run([sys.executable, "-c", READS_WITHOUT_TENSORFLOW, str(root)], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_speech_source_on_the_espeak_corpus_gives_alignable_batches(tiny_corpus):
    _, root = tiny_corpus
    src = data.get({"name": "speech", "dataset": "local:tiny", "data_dir": str(root), "train_split": "train",
                    "eval_split": "validation", "vocab_size": 48, "max_frames": 400, "buckets": (400,)})
    batch = next(src.train_batches(4, 0, 0))
    assert batch["features"].shape[:2] == (4, 400)
    assert batch["features"].shape[2] == 80 and batch["features"].dtype == np.float32
    assert batch["labels"].shape[1] == int(speech.subsampled_length(batch["features"].shape[1]))
    assert np.all(batch["valid"]) and np.all(batch["label_lengths"] > 0)
    frames = np.asarray(speech.subsampled_length(batch["feature_lengths"]))
    assert np.all(ctc.alignable(batch["labels"], batch["label_lengths"], frames))
    again = next(src.train_batches(4, 0, 0))          # SpecAugment from the per-example rngs: reproducible
    np.testing.assert_array_equal(batch["features"], again["features"])
    stream = src.train_batches(4, 0, 0)
    third = [next(stream) for _ in range(3)][2]
    resumed = next(src.train_batches(4, 2, 0))         # a restart at step 2 reads step 2's batch exactly
    for k in third:
        np.testing.assert_array_equal(third[k], resumed[k])
    evals = list(src.eval_batches(3))
    assert sum(int(b["valid"].sum()) for b in evals) == 4
    task = ctc.Ctc()
    task.bind(src)              # the tokenizer: the speech source's (as the trainer binds it)
    assert task.text(batch["labels"][0, :batch["label_lengths"][0]]) == " ".join(
        speech._text(src.sources["train"][int(src.train_indices(4, 0, 0)[0])]["text"]).split())

    # the task on real clips: every row aligned; the loss is per label token (utterance mean × rows / tokens)
    from favor import models
    vocab = src.tokenizer.vocab_size
    model = models.get("conformer", "tiny", features=80, vocab_size=vocab,
                       attention={"kind": "favor++", "num_features": 8})
    loss, metrics = nnx.jit(lambda m, b: task.loss(m, b, deterministic=True))(model, batch)
    assert float(metrics["aligned_fraction"]) == 1.0 and float(loss) > 0
    np.testing.assert_allclose(float(loss), float(metrics["utterance_loss"]) * 4 / batch["label_lengths"].sum(),
                               rtol=1e-6)
    out = task.finalize([jax.device_get(nnx.jit(task.eval_outputs)(model, evals[0]))])
    assert out["wer"] >= 0 and np.isfinite(out["loss"])
    small = models.get("conformer", "tiny", features=80, vocab_size=vocab - 1)
    with pytest.raises(ValueError, match=f"tokenizer has {vocab} pieces; set model.vocab_size ≥ {vocab}"):
        nnx.jit(lambda m, b: task.loss(m, b))(small, batch)     # raised while tracing


# -- errors --------------------------------------------------------------------------------------------
def test_missing_or_unprepared_data_says_what_to_do(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"librispeech .*not prepared.*tfds build librispeech"):
        data.get({"name": "speech", "data_dir": str(tmp_path)})
    with pytest.raises(FileNotFoundError, match=r"data_dir .*nowhere does not exist"):
        data.get({"name": "speech", "data_dir": str(tmp_path / "nowhere")})
    with pytest.raises(ValueError, match=r"unknown speech dataset 'timit'.*'librispeech', 'local'"):
        data.get({"name": "speech", "dataset": "timit"})
    with pytest.raises(ValueError, match=r"got unknown option\(s\) 'max_length'"):
        data.get({"name": "speech", "max_length": 3})


def test_hard_espeak_corpus_draws_longer_noisier_perturbed_speech_and_keeps_the_default_corpus():
    """favor_speech/hard: one or two phrases from the wider grammar, its rates, 5–20 dB SNR and a speed
    perturbation that shortens or lengthens the 16 kHz clip by the resampling ratio; the default corpus's
    draws are those it always had (pinned values)."""
    from favor.data import espeak
    hard = next(c for c in espeak.FavorSpeech.BUILDER_CONFIGS if c.name == "hard")
    assert next(c for c in espeak.FavorSpeech.BUILDER_CONFIGS if c.name == "hard_tiny").sizes == (8, 4, 4)
    words = set(espeak.DIGITS) | {w for group in espeak.WIDE.values() for p in group for w in p.split()} | \
        {"THE", "WHERE", "IS", "HERE"}
    draws = [espeak.draw(0, split, i, hard) for split in espeak.SPLITS for i in range(40)]
    assert all(set(d.text.split()) <= words for d in draws)
    assert {"WHERE", "SHELF", "PURPLE"} & {w for d in draws for w in d.text.split()}     # the wider grammar is used
    assert all(110 <= d.rate <= 250 and 5 <= d.snr_db <= 20 and 0.9 <= d.speed <= 1.1 for d in draws)
    assert max(len(d.text.split()) for d in draws) > 7           # two phrases: longer than any default utterance
    assert len({round(d.speed, 3) for d in draws}) > 30
    for i in (0, 3):
        d = espeak.draw(0, "train", i, hard)
        native = espeak.synthesize(d.text, espeak.VOICES[d.speaker], d.rate, d.pitch)
        ex = espeak.utterance(0, "train", i, config=hard)
        assert ex["text"] == d.text and ex["speech"].dtype == np.int16
        assert len(ex["speech"]) == math.ceil(len(native) * 320 / round(441 * d.speed)), (d.speed, len(native))
    # the default corpus: the same draws as ever (versions 1.2.0 and 1.3.0 hold the same samples)
    pinned = {("train", 0): ("OPEN THE GREEN DOOR", 0, 131, 33, 42.132716),
              ("validation", 5): ("ONE ONE FOUR", 10, 162, 47, 32.454537),
              ("test", 7): ("TAKE THE BLACK CUP ON THE RIGHT", 12, 175, 61, 33.650831)}
    for (split, i), want in pinned.items():
        d = espeak.draw(0, split, i)
        assert (d.text, d.speaker, d.rate, d.pitch, round(d.snr_db, 6), d.speed) == want + (1.0,)
    c = conformer_librispeech.get_config("data=hard")
    assert c.data.dataset == "local:hard" and c.data.max_frames == 480 and c.model.vocab_size == 96
