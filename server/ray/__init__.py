"""loraplex on Ray Serve (``loraplex serve --ray``): engine replicas behind Ray Serve's gRPC
proxy. Importing this package imports ray; the single-process server never does."""
