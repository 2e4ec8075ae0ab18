"""The engine: S²-MoE self-speculative decoding, expert offloading and their measurement, on stock llama.cpp.

Front ends (the app, the API server, the scripts) use the engine through its public modules: the top-level
ones (errors, events, model_info, profiles, files, modes, …), the modules of decoding/, drafting/ and
measure/ that INTERNAL does not name, offload/ through its package alone, and zoo/'s package, synthetic and
widen. The modules INTERNAL names are parts of a larger piece (the decoder's, the drafting rules', the
projection's, tune's, calibration's worker) and change shape with it; tests/test_layout.py keeps the front
ends off them.
"""

INTERNAL = (
    "decoding.acceptance",
    "decoding.cost_constants",
    "decoding.observer",
    "decoding.runtime",
    "decoding.tree",
    "drafting.copylearner",
    "drafting.drafters",
    "drafting.ngrams",
    "drafting.stoprules",
    "measure.cache_model",
    "measure.calibration_budget",
    "measure.calibration_worker",
    "measure.offload_bench",
    "measure.remembered_costs",
    "measure.replay_costs",
    "measure.trace_replay",
    "measure.tune_constraints",
    "measure.tune_space",
    "measure.tune_timing",
    "offload.*",
    "zoo.data",
    "zoo.evaluate",
    "zoo.export",
    "zoo.model",
    "zoo.tokenizer",
    "zoo.train",
)
