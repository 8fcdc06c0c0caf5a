"""The engine's workers as Ray actors: a session on a local or existing cluster (`session`),
one actor per rank (`actor`), the executor that dispatches to them (`executor`, `calls`,
`rank_calls`), FSDP2 sharding and its checkpoints (`fsdp`, `fsdp_checkpoint`), and the check
that every node sees the run's storage (`shared_storage`). Only `RayBackend` imports these.
"""
