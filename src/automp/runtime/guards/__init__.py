"""What keeps a chosen path safe for the rest of the run: each guard watches one way a compiled or low-precision path
can go wrong in a real script (recompiles, double backward, RNNs, graph breaks, logging that compiles once, outputs
nobody reads, a rank that died) and moves the root back, or out of the way, with a reason in the report."""
