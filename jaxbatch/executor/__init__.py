"""How devices and replicas are driven: the mesh and parameter sharding, multi-host start-up,
data-parallel replicas in one process, and replicas as Ray actors."""
