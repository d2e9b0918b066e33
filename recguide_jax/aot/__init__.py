"""Ahead-of-time compilation for accelerators this host does not have: the real TPU compiler (libtpu) and XLA:GPU
compile the engine's step variants from abstract weights against a named chip and topology (`targets`), and the
optimized programs are read for what decides memory and speed on the device (`inspect`)."""
