"""Decoding modes (kept free of heavy imports so the CLI parser can list them quickly)."""

MODES = ("ar", "s2moe", "naive", "conf", "cascade", "lookup")
# Modes that draft with the model's own experts and so need a Mixture-of-Experts model.
MOE_MODES = ("s2moe", "naive", "conf", "cascade")
# Modes whose greedy output must equal plain decoding token for token (no approximation anywhere).
LOSSLESS_MODES = ("ar", "naive", "conf", "cascade", "lookup")
