"""pdstack: prefill/decode-disaggregated vLLM + LMCache + NIXL stacks from one topology."""

__version__ = "0.1.0"
