"""Tests in a real browser: a ComfyUI server with this pack, and ComfyUI's own frontend in headless Chromium."""
