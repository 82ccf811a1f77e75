"""``kvadvisor demo --engine vllm``: the loop with real vLLM engines (:mod:`.run`)."""
