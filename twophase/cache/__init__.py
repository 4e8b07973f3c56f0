"""The cache's description: a typed spec a layer group (``spec``) and the one function that lays
the pool out from the specs and the memory free (``layout``)."""
