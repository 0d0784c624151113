"""loraplex on Ray Serve (``loraplex serve --ray``): engine replicas behind Ray Serve's gRPC
proxy. Its modules import ray, except ray_options.py (RayOptions: the flags every parser has);
importing the package itself imports nothing, and the single-process server never imports
ray."""
