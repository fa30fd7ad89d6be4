"""Scaling laws you can run: the published laws (:mod:`.laws`), fitting them to runs (:mod:`.fit`),
planning a run for a budget (:mod:`.plan`) and IsoFLOP sweeps on your own corpus (:mod:`.sweep`,
:mod:`.report`). Only :mod:`.fit`'s Approach 3 needs scipy; everything else runs on the core install."""
