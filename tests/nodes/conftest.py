from tests.comfy_env import comfy  # noqa: F401  (the session ComfyUI fixture)
