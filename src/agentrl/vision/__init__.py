"""Images through the loop (docs/images.md): checked and content-addressed (``images``), and the Qwen-VL family's
image tokens and pixel inputs (``processor``), shared by samplers, ``agentrl engine`` and the trainer. It imports
no other AgentRL package."""
