"""The pieces of a block, with parameters: positions, norms, the feed-forward, soft-capping, the
embedding helpers and the init / weight-decay markers. Nothing is re-exported: import from the module."""
