"""Soak, chaos and invariants (#43): hours of mixed traffic through every door while
seeded faults hit the cluster, then checks that nothing was lost or leaked. See run.py."""
