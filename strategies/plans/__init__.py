"""Parallel plans by module name: glob patterns mapped to styles (`styles`), applied by
`module_plan`, derived (`derive`), checked (`checks`), priced (`costs`); Megatron-LM's sequence
parallelism of norms (`sequence_parallel`).
"""
