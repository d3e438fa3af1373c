"""What a request will count against its key's tokens per minute before any tokenizer has seen it:
the ingress reserves this much at admission (router/residency/limits.py corrects it to what the
model reports when the lease ends)."""

import math

ASCII_BYTES_PER_TOKEN = 3  # BPE vocabularies average about 4 bytes of English or code per token


def estimate_tokens(*texts: str) -> int:
    """An upper-ish estimate of the tokens `texts` make, before any tokenizer has seen them: what a
    request reserves of its key's tpm at admission (its real count replaces it when it ends). ASCII
    counts a token per 3 bytes, plus one more per digit (Llama's and Qwen's tokenizers split numbers
    into single digits), and every byte beyond ASCII counts a token (an English-centred vocabulary
    spends about that on accents and CJK). Above a BPE tokenizer's count for English, code, numbers
    and non-Latin text (tests/test_limits.py checks SmolLM2's), so concurrent long prompts cannot
    pass a key's budget on a low guess; for multilingual vocabularies it can be a few times high.
    Cheap: C-level passes over each text, no tokenizer in the ingress."""
    total = 0.0
    for text in texts:
        ascii_bytes = len(text.encode("ascii", "ignore"))
        digits = sum(map(text.count, "0123456789"))
        total += ascii_bytes / ASCII_BYTES_PER_TOKEN + digits + (len(text.encode()) - ascii_bytes)
    return math.ceil(total)


AUDIO_TOKENS_PER_S = 10  # what a second of audio counts (a transcription's input; Orchard's own rate)
AUDIO_BYTES_PER_S = 32_000  # 16 kHz 16-bit mono, what speech-to-text models decode to: the admission estimate


def audio_tokens(seconds: float) -> int:
    """The tokens `seconds` of audio count against a key's tpm (AUDIO_TOKENS_PER_S, rounded up)."""
    return math.ceil(max(0.0, seconds) * AUDIO_TOKENS_PER_S)
