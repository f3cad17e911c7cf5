"""The generate role for speech: the Qwen2.5-Omni and Qwen3-Omni talkers with their vocoders, and Qwen3-TTS."""
