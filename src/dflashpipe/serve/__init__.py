"""The drafter served by a real engine: the served check (`served_check`), our proposals along the engine's run
(`replay`), vLLM's offline engine in the serving environment (`engine`, `vllm_run`).

vLLM's OpenAI server, which only the tests and a benchmark start, is tests/vllm_server.py."""
