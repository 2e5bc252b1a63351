"""Who runs a forward when: the forward lock, background encoding, the miss policy and its costs."""
