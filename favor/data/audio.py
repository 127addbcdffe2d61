"""Speech features: 16 kHz audio -> 80-bin log-mel frames (25 ms window, 10 ms hop), per-utterance
mean/variance normalisation, and SpecAugment. Numpy in, numpy out.

    feats, lengths = log_mel([wave_0, wave_1, ...])   # [N, T, 80] float32, [N] int32 (ceil(samples / 160))
    feats = normalize(feats, lengths)                 # zero mean, unit variance per bin over valid frames
    x = spec_augment(feats[i, :lengths[i]], rng)      # masked copy (masks set to 0 = the mean)

The STFT is numpy's real FFT over periodic-Hann frames and the filterbank the HTK-mel triangles of
`tf.signal.linear_to_mel_weight_matrix` (the tests check both against TensorFlow's), run once per batch
of utterances; numpy rather than TensorFlow because importing TensorFlow costs each training process
seconds of start-up. Parameters are the usual ASR front end (Conformer, Gulati et al. 2020: 80
filterbank channels, 25 ms window, 10 ms stride); the band is 20 Hz - 8 kHz (Kaldi's default edges at
16 kHz: the whole band up to Nyquist).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

SAMPLE_RATE = 16000
WINDOW = 400          # 25 ms at 16 kHz
HOP = 160             # 10 ms
FFT = 512             # next power of two above the window
NUM_MELS = 80
LOWER_HZ, UPPER_HZ = 20.0, 8000.0
LOG_FLOOR = 1e-6      # mel power floor before the log: ~100 dB under a full-scale tone (int16 full scale = 1.0)
NORM_EPS = 1e-5


def num_frames(num_samples):
    """Frames of an utterance of `num_samples` (the last frame zero-padded): ceil(samples / HOP), ≥ 1."""
    return np.maximum(-(-np.asarray(num_samples) // HOP), 1)


@functools.lru_cache(maxsize=None)
def mel_matrix(num_mels: int = NUM_MELS, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """[FFT // 2 + 1, num_mels] triangular HTK-mel filters over the power spectrum: num_mels + 2 edges
    evenly spaced in mel (1127 ln(1 + f / 700)) from LOWER_HZ to min(UPPER_HZ, Nyquist), each filter
    rising from its lower edge to its centre and falling to its upper edge; the DC bin has no weight."""
    mel = lambda hz: 1127.0 * np.log1p(np.asarray(hz, np.float64) / 700.0)
    edges = np.linspace(mel(LOWER_HZ), mel(min(UPPER_HZ, sample_rate / 2)), num_mels + 2)
    lower, centre, upper = edges[:-2], edges[1:-1], edges[2:]
    bins = mel(np.linspace(0.0, sample_rate / 2, FFT // 2 + 1)[1:])[:, None]
    rise, fall = (bins - lower) / (centre - lower), (upper - bins) / (upper - centre)
    weights = np.maximum(0.0, np.minimum(rise, fall))
    return np.concatenate([np.zeros((1, num_mels)), weights]).astype(np.float32)


def _as_float(wave) -> np.ndarray:
    w = np.asarray(wave)
    if w.ndim != 1:
        raise ValueError(f"audio must be a 1-D waveform; got shape {w.shape}")
    if np.issubdtype(w.dtype, np.integer):
        if w.dtype != np.int16:
            raise ValueError(f"integer audio must be int16 PCM; got {w.dtype}")
        return w.astype(np.float32) / 32768.0
    return w.astype(np.float32)


def log_mel(waves, sample_rate: int = SAMPLE_RATE, num_mels: int = NUM_MELS):
    """Log-mel energies of a list of waveforms (int16 PCM or float in [-1, 1]).

    Returns (features [N, T, num_mels] float32, lengths [N] int32) with T the longest utterance's
    frame count; frames past an utterance's length are 0. Frame i covers samples [160 i, 160 i + 400)
    with a periodic Hann window; samples past the end are zeros (so a short clip still has a frame)."""
    if sample_rate != SAMPLE_RATE:
        raise ValueError(f"log_mel expects {SAMPLE_RATE} Hz audio (25 ms = {WINDOW} samples); got {sample_rate} Hz")
    waves = [_as_float(w) for w in waves]
    if not waves:
        return np.zeros((0, 1, num_mels), np.float32), np.zeros((0,), np.int32)
    lengths = num_frames([len(w) for w in waves]).astype(np.int32)
    frames = int(lengths.max())
    # frame i reads samples [HOP i, HOP i + WINDOW); the end is zero-padded so every frame is whole
    x = np.zeros((len(waves), (frames - 1) * HOP + WINDOW), np.float32)
    for i, w in enumerate(waves):
        x[i, :len(w)] = w
    framed = np.lib.stride_tricks.sliding_window_view(x, WINDOW, axis=1)[:, ::HOP]      # [N, T, WINDOW]
    hann = (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(WINDOW) / WINDOW)).astype(np.float32)   # periodic
    power = np.square(np.abs(np.fft.rfft(framed * hann, FFT, axis=-1)))                 # [N, T, FFT/2 + 1]
    mel = power.astype(np.float32) @ mel_matrix(num_mels, sample_rate)                  # [N, T, num_mels]
    feats = np.log(np.maximum(mel, LOG_FLOOR)).astype(np.float32)
    feats[np.arange(feats.shape[1])[None, :] >= lengths[:, None]] = 0.0
    return feats, lengths


def normalize(features: np.ndarray, lengths) -> np.ndarray:
    """Per-utterance, per-bin mean/variance normalisation over the valid frames; padding stays 0.

    Per utterance rather than a global statistic: nothing to estimate or store per dataset, and it
    removes the channel (microphone, synthesiser voice) offset that a global mean would keep."""
    x = np.asarray(features, np.float32)
    valid = (np.arange(x.shape[1])[None, :] < np.asarray(lengths)[:, None])[..., None]
    n = np.maximum(valid.sum(1, keepdims=True), 1)
    mean = np.where(valid, x, 0).sum(1, keepdims=True) / n
    var = np.where(valid, np.square(x - mean), 0).sum(1, keepdims=True) / n
    return np.where(valid, (x - mean) / np.sqrt(var + NORM_EPS), 0).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class SpecAugmentPolicy:
    """Frequency masks as the LibriSpeech "LD" policy of Park et al. 2019 (SpecAugment, Table 1: m_F = 2
    masks of width f ~ U[0, F], F = 27 of 80 bins); time masks adaptive in the utterance length as in
    Park et al. 2020 ("SpecAugment on large scale datasets"), with the Conformer paper's setting (Gulati
    et al. 2020, "Data" paragraph: ten masks, each at most p_S = 0.05 of the utterance). Adaptive width keeps short
    utterances from being wiped out by LD's fixed T = 100 frames. Time warping is left out: it gave the
    smallest gain in Park et al. 2019 and the Conformer recipe does not use it."""
    freq_masks: int = 2
    freq_width: int = 27
    time_masks: int = 10
    time_ratio: float = 0.05


LIBRISPEECH = SpecAugmentPolicy()


def spec_augment_masks(length: int, num_bins: int, rng: np.random.Generator,
                       policy: SpecAugmentPolicy = LIBRISPEECH):
    """(time_mask [length] bool, freq_mask [num_bins] bool), True = masked.

    Each frequency mask: f ~ U{0..F} (F capped at num_bins), f0 ~ U{0..num_bins − f}, bins [f0, f0 + f).
    Each time mask: t ~ U{0..⌊p_S · length⌋}, t0 ~ U{0..length − t}, frames [t0, t0 + t)."""
    freq = np.zeros(num_bins, bool)
    for _ in range(policy.freq_masks):
        f = int(rng.integers(0, min(policy.freq_width, num_bins) + 1))
        f0 = int(rng.integers(0, num_bins - f + 1))
        freq[f0:f0 + f] = True
    time = np.zeros(length, bool)
    widest = int(np.floor(policy.time_ratio * length))
    for _ in range(policy.time_masks):
        t = int(rng.integers(0, widest + 1))
        t0 = int(rng.integers(0, length - t + 1))
        time[t0:t0 + t] = True
    return time, freq


def spec_augment(features: np.ndarray, rng: np.random.Generator, policy: SpecAugmentPolicy = LIBRISPEECH):
    """A masked copy of one utterance's normalised features [T, bins]; masked entries are 0 (the
    per-utterance mean after `normalize`, as Park et al. fill masks with the mean)."""
    x = np.array(features, np.float32)
    if x.ndim != 2:
        raise ValueError(f"spec_augment takes one utterance [frames, bins]; got shape {x.shape}")
    time, freq = spec_augment_masks(x.shape[0], x.shape[1], rng, policy)
    x[time] = 0.0
    x[:, freq] = 0.0
    return x
