"""`corestream serve`: the launcher, its configuration, the supervision of its children
and their restart policy."""
