"""Decoding modes (kept free of heavy imports so the CLI parser can list them quickly)."""

# tree: S²-MoE drafting a tree (s2moe --tree); tree-prob: the same tree by draft probability alone (T_exp = 0)
# ls: self-drafting with the routed experts of every other MoE layer skipped (the paper's LS baseline)
MODES = ("ar", "s2moe", "naive", "conf", "cascade", "lookup", "tree", "tree-prob", "ls")
# Modes that draft with the model's own experts and so need a Mixture-of-Experts model.
MOE_MODES = ("s2moe", "naive", "conf", "cascade", "tree", "tree-prob", "ls")
# Modes whose draft passes are a chain of the target's own top-k_d experts (drafters.SelfDrafter): under a
# memory budget they can draft from the experts in memory instead (GenerationConfig.draft_experts).
CHAIN_DRAFT_MODES = ("s2moe", "conf", "cascade")
# What self-drafting passes (a chain's or a tree's) can read under a memory budget (GenerationConfig.draft_experts).
DRAFT_EXPERTS = ("resident", "router")
# Modes that draft trees (engine.decoding.tree).
TREE_MODES = ("tree", "tree-prob")
# Modes whose greedy output must equal plain decoding token for token (no approximation anywhere).
LOSSLESS_MODES = ("ar", "naive", "conf", "cascade", "lookup", "tree-prob", "ls")
