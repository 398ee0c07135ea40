"""The HTTP gateway: KServe V2 and OpenAI APIs, jobs, metrics and status, over a `Service`."""
