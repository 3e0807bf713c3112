"""The prefix cache's events in vLLM's wire format, for routers built around vLLM
(llm-d's KV-cache indexer, NVIDIA Dynamo, the SGLang model gateway): a ZeroMQ PUB
socket and a replay ROUTER beside the engine's own event stream to its frontends."""
