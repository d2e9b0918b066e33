"""Scale-out with JAX's own SPMD: meshes and sharding rules (`sharding`), multi-host start (`multihost`), data-parallel engine groups (`data_parallel`)."""
