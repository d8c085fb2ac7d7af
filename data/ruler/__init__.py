"""RULER's synthetic long-context tasks, generated offline: `data.ruler.tasks` (the tasks and their
exact-length prompts), `data.ruler.haystack` (noise and essay haystacks), `data.ruler.words`
(the random needles). Shared by evaluation (`eval.ruler`) and training rows (`data.synthetic`)."""
