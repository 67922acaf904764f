"""Kaldi's MFCCs with deltas, in numpy: the features HuBERT's first iteration clusters (Hsu et
al. 2021 §IV-B: "39-dimensional MFCC features, 13 coefficients with the first and second-order
derivatives").

Reference: fairseq `examples/hubert/simple_kmeans/dump_mfcc_feature.py`, which computes
`torchaudio.compliance.kaldi.mfcc(waveform, sample_frequency, use_energy=False)` of the
waveform in [-1, 1], then `torchaudio.functional.compute_deltas` twice, at Kaldi's defaults
(compute-mfcc-feats): 25 ms frames every 10 ms (100 Hz) that fit in the utterance (snip_edges),
no dither, each frame's mean removed, pre-emphasis 0.97, Povey window (Hann^0.85), FFT over 512
samples at 16 kHz, power spectrum, 23 triangular mel bands from 20 Hz to Nyquist (mel = 1127
ln(1 + f / 700)), log (floored at float32 epsilon), orthonormal DCT-II to 13 coefficients,
sinusoidal liftering with L = 22; deltas over +-2 frames, (sum_n n (c[t+n] - c[t-n])) / 10,
with the edge frames repeated. tests/test_hubert.py compares `kaldi_mfcc` with
kaldi-native-fbank's C++ implementation of Kaldi's.
"""

from __future__ import annotations

import math

import numpy as np

FRAME_SECONDS, SHIFT_SECONDS = 0.025, 0.010
PREEMPHASIS = 0.97
NUM_MEL_BINS, LOW_FREQUENCY = 23, 20.0
NUM_CEPS, CEPSTRAL_LIFTER = 13, 22.0
DELTA_WINDOW = 2  # torchaudio compute_deltas' win_length 5
LOG_FLOOR = float(np.finfo(np.float32).eps)


def mel(frequency: np.ndarray | float) -> np.ndarray | float:
    """Kaldi's mel scale, 1127 ln(1 + f / 700)."""
    return 1127.0 * np.log1p(np.asarray(frequency) / 700.0)


def mel_banks(sample_rate: int, fft_size: int) -> np.ndarray:
    """[fft_size // 2 + 1, bins] Kaldi's triangular mel filters (`MelBanks`): equally spaced
    in mel from `LOW_FREQUENCY` to Nyquist, over the FFT bins below Nyquist (Nyquist's weight
    is 0)."""
    low, high = mel(LOW_FREQUENCY), mel(sample_rate / 2.0)
    delta = (high - low) / (NUM_MEL_BINS + 1)
    left = low + delta * np.arange(NUM_MEL_BINS)
    center, right = left + delta, left + 2 * delta
    bins = mel(np.arange(fft_size // 2) * sample_rate / fft_size)[:, None]  # [F - 1, 1]
    up, down = (bins - left) / (center - left), (right - bins) / (right - center)
    weights = np.maximum(0.0, np.minimum(up, down))
    return np.concatenate([weights, np.zeros((1, NUM_MEL_BINS))])


def dct_lifter() -> np.ndarray:
    """[bins, ceps] the orthonormal DCT-II to `NUM_CEPS` coefficients times Kaldi's lifter
    1 + (L / 2) sin(pi i / L)."""
    n, k = np.arange(NUM_MEL_BINS)[:, None], np.arange(NUM_CEPS)[None]
    dct = np.sqrt(2.0 / NUM_MEL_BINS) * np.cos(math.pi / NUM_MEL_BINS * (n + 0.5) * k)
    dct[:, 0] = math.sqrt(1.0 / NUM_MEL_BINS)
    lifter = 1.0 + 0.5 * CEPSTRAL_LIFTER * np.sin(math.pi * np.arange(NUM_CEPS)
                                                  / CEPSTRAL_LIFTER)
    return dct * lifter


def kaldi_mfcc(waveform: np.ndarray, sample_rate: int) -> np.ndarray:
    """[frames, 13] float32 MFCCs of a mono waveform in [-1, 1] (module docstring), frames =
    1 + (n - 25 ms) // 10 ms (none for a waveform under 25 ms)."""
    length = round(FRAME_SECONDS * sample_rate)
    shift = round(SHIFT_SECONDS * sample_rate)
    x = np.asarray(waveform, np.float64)
    count = 1 + (len(x) - length) // shift if len(x) >= length else 0
    if count == 0:
        return np.zeros((0, NUM_CEPS), np.float32)
    frames = x[np.arange(count)[:, None] * shift + np.arange(length)]  # [N, length]
    frames = frames - frames.mean(axis=1, keepdims=True)
    frames = frames - PREEMPHASIS * np.concatenate([frames[:, :1], frames[:, :-1]], axis=1)
    hann = 0.5 - 0.5 * np.cos(2 * math.pi * np.arange(length) / (length - 1))
    fft_size = 1 << (length - 1).bit_length()
    power = np.abs(np.fft.rfft(frames * hann ** 0.85, n=fft_size)) ** 2  # [N, F]
    energies = np.log(np.maximum(power @ mel_banks(sample_rate, fft_size), LOG_FLOOR))
    return (energies @ dct_lifter()).astype(np.float32)


def deltas(features: np.ndarray) -> np.ndarray:
    """[frames, d] -> [frames, d]: sum_{n=1..2} n (x[t+n] - x[t-n]) / 10, the edge frames
    repeated (torchaudio `compute_deltas`, mode "replicate")."""
    if len(features) == 0:
        return np.zeros_like(features, np.float32)
    padded = np.pad(features, ((DELTA_WINDOW, DELTA_WINDOW), (0, 0)), mode="edge")
    count = len(features)
    total = sum(n * (padded[DELTA_WINDOW + n:DELTA_WINDOW + n + count]
                     - padded[DELTA_WINDOW - n:DELTA_WINDOW - n + count])
                for n in range(1, DELTA_WINDOW + 1))
    norm = 2 * sum(n * n for n in range(1, DELTA_WINDOW + 1))
    return (total / norm).astype(np.float32)


def mfcc_with_deltas(waveform: np.ndarray, sample_rate: int) -> np.ndarray:
    """[frames, 39] float32 at 100 Hz: `kaldi_mfcc`, its deltas and delta-deltas
    (dump_mfcc_feature.py's features)."""
    mfcc = kaldi_mfcc(waveform, sample_rate)
    first = deltas(mfcc)
    return np.concatenate([mfcc, first, deltas(first)], axis=1)
