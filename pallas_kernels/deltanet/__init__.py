"""The Gated DeltaNet recurrence on CPU: cpu.py + cpu_deltanet.cc, the delta rule of a step on
the layer's state slots in place (the jnp forms and their spec: jaxbatch/model/archs/deltanet.py)."""
