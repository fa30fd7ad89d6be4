"""One module per claim, each defining ``CLAIM``; found by ``tformer.claims.registry``."""
