"""Plans kept for replay by C: the plan cache of repeated calls and the launch programs of the XLA
handler."""
