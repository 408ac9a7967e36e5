"""The shipped default prompt set of `--data.source prompts`: a few thousand prompts from our own word lists.

Every prompt fills one template with a subject, a setting, a style, a composition and a light, all
written for this project (no dataset is copied). The full product of the lists holds millions of
prompts; `default_prompts` walks it with a fixed stride coprime to its size, so the first prompts
already vary in every part, the order never changes, and no prompt repeats. Compositions say nothing
about the frame's shape: the aspect ratio is the bucket's, assigned by `trainer.inputs.prepare`.
"""

from __future__ import annotations

import math

__all__ = ["DEFAULT_PROMPT_COUNT", "default_prompts"]

DEFAULT_PROMPT_COUNT = 3000
"""Prompts in the shipped set (about 2 samples per prompt over the 24 GB recipe's 3000 steps of batch 2)."""

_TEMPLATES = (
    "{style} of {subject} {setting}, {composition}, {light}",
    "{subject} {setting}, {style}, {light}, {composition}",
    "{composition} of {subject} {setting}, {style}, {light}",
    "{style}: {subject} {setting}, {light}, {composition}",
)
_SUBJECTS = (
    "a red fox", "an old lighthouse", "a bowl of ramen", "a vintage motorcycle", "a sleeping cat",
    "a wooden sailboat", "a stack of old books", "a hot air balloon", "an elderly fisherman", "a glass teapot",
    "a young dancer", "a steam locomotive", "a field of sunflowers", "a snow leopard", "a small cottage",
    "a bicycle leaning on a wall", "a pair of hiking boots", "a street musician", "a koi pond", "a robot",
    "a bowl of ripe cherries", "a mountain goat", "a clock tower", "a bonsai tree", "a paper lantern",
    "a knight in armor", "a cup of coffee", "a grand piano", "a family of ducks", "a desert cactus",
    "a blacksmith at work", "a yellow taxi", "a jellyfish", "a tabby kitten", "a stone bridge",
    "a chess board", "a vase of tulips", "an astronaut", "a windmill", "a barn owl",
    "a child flying a kite", "a loaf of fresh bread", "a sports car", "a tree house", "a humpback whale",
    "a potter shaping clay", "a carousel", "a hummingbird", "a ceramic mug", "a castle",
    "a golden retriever", "a bowl of fruit", "a street market stall", "a violin", "a wolf",
    "a vintage typewriter", "a greenhouse", "a ballerina", "a fire truck", "a parrot",
    "a pile of autumn leaves", "a tiny sailboat in a bottle", "a samurai", "a pumpkin", "a tram",
    "an old man reading a newspaper", "a pair of red shoes", "a polar bear", "a wooden cabin", "a pocket watch",
)  # fmt: skip
_SETTINGS = (
    "in a misty pine forest", "on a rainy city street at night", "on a sandy beach", "in a cozy kitchen",
    "on a snowy mountain ridge", "in a busy train station", "in a quiet library", "beside a calm lake",
    "in a flower meadow", "on a rooftop above the city", "in an abandoned factory", "in a desert canyon",
    "in a small fishing village", "under a starry sky", "in a bamboo grove", "at a harbor at dawn",
    "in a sunlit living room", "in a medieval town square", "on a wooden pier", "in a tropical jungle",
    "in a foggy valley", "on a country road", "in an art studio", "in a greenhouse full of plants",
    "inside a cathedral", "on a frozen lake", "in a neon-lit alley", "in a vineyard", "on a windswept cliff",
    "in front of a brick wall",
)  # fmt: skip
_STYLES = (
    "a photograph", "an oil painting", "a watercolor painting", "a pencil sketch", "a 3d render",
    "a cinematic film still", "an ink drawing", "a vintage postcard", "a children's book illustration",
    "a studio photograph", "an isometric illustration", "a charcoal drawing", "a pastel drawing",
    "a linocut print", "a matte painting", "a polaroid photo", "a gouache painting", "a comic book panel",
    "a black and white photograph", "a digital painting", "a paper cut-out collage", "an impressionist painting",
    "a detailed botanical-style illustration", "a claymation still",
)  # fmt: skip
_COMPOSITIONS = (
    "a close-up", "a wide shot", "a view from above", "a low-angle view", "a centered composition",
    "a symmetrical composition", "a view from behind", "a macro shot", "a side view", "an over-the-shoulder view",
    "a medium shot", "a distant view", "an eye-level view", "a three-quarter view",
)  # fmt: skip
_LIGHTS = (
    "soft morning light", "golden hour light", "overcast daylight", "neon lighting", "candlelight",
    "harsh midday sun", "blue hour", "soft studio lighting", "backlit", "moonlight", "dramatic rim light",
    "warm lamplight", "dappled sunlight", "stormy light",
)  # fmt: skip
_PARTS = {
    "template": _TEMPLATES,
    "subject": _SUBJECTS,
    "setting": _SETTINGS,
    "style": _STYLES,
    "composition": _COMPOSITIONS,
    "light": _LIGHTS,
}


def _stride(total: int) -> int:
    """A step coprime to `total` near `total / golden ratio`, so consecutive prompts differ in every part."""
    step = round(total / (1 + math.sqrt(5)) * 2)
    while math.gcd(step, total) != 1:
        step += 1
    return step


def _compose(index: int) -> str:
    """Prompt `index` of the product of the lists (mixed radix, template first)."""
    chosen = {}
    for name, options in reversed(_PARTS.items()):
        index, digit = divmod(index, len(options))
        chosen[name] = options[digit]
    text = chosen.pop("template").format(**chosen)
    return text[0].upper() + text[1:]


def default_prompts(count: int = DEFAULT_PROMPT_COUNT) -> list[str]:
    """The first `count` prompts of the shipped set, in a fixed order and without repeats.

    Args:
        count (`int`): how many prompts, at most the size of the product of the word lists.
            Default: `DEFAULT_PROMPT_COUNT`.

    Raises:
        ValueError: `count` below 1 or beyond the product.
    """
    total = math.prod(len(options) for options in _PARTS.values())
    if not 1 <= count <= total:
        raise ValueError(f"the default prompt set holds 1 to {total} prompts; asked for {count}.")
    step = _stride(total)
    return [_compose(k * step % total) for k in range(count)]
