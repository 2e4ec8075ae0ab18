"""Decoding on stock llama.cpp: the runtime, the routing hook, the decoder loop, sampling, verification, trees, chat."""
