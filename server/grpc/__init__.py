"""The gRPC front: the servicers (Inference, AdapterAdmin, ServerInfo, Health), proto <->
engine values, the response messages, the status map and the token interceptor, over the
front-neutral layer in server/ (as server/http/ is the HTTP front)."""
