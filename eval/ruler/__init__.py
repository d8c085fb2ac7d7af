"""RULER's synthetic tasks as an evaluation (`python -m eval task=ruler`): greedy generation
(`eval.ruler.generation`), RULER's string-match scoring (`eval.ruler.score`), its tables and figure
(`eval.ruler.report`). The prompts come from `data.ruler`, shared with training rows."""
