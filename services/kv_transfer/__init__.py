"""kv_transfer: holds each request's KV between prefill and decode under a lease."""
