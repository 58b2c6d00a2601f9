"""The bundled prompt set `baton train-draft` generates its training text from.

Short, varied chat requests (explanations, lists, code, rewriting, stories),
none of them the benchmark's questions, so acceptance measured there is on
prompts the head never saw: 64 written out, then every request template crossed
with every subject (`TEMPLATES` x `SUBJECTS`, 1,640). 64 prompts were too
few: a head trained on them reached 1.36 tokens per step on the held-out
questions, against 2.0 wanted; what the head must learn is how this model
phrases answers, and that takes many different answers.
"""

from __future__ import annotations

TRAIN_PROMPTS: tuple[str, ...] = (
    "Explain how a rainbow forms.", "What is photosynthesis?", "Describe the life cycle of a butterfly.",
    "Why is the ocean salty?", "How does a refrigerator keep food cold?", "What causes earthquakes?",
    "Explain the difference between weather and climate.", "How do vaccines work?",
    "What is the theory of evolution?", "Describe how the heart pumps blood.", "What is gravity?",
    "How do plants grow from seeds?", "Why do leaves change color in autumn?", "What is an atom made of?",
    "Explain what a black hole is.", "How does the internet work?", "What is a computer program?",
    "Write a Python function that reverses a string.", "Write a Python function that checks for a palindrome.",
    "Write a function that returns the largest number in a list.", "Explain what a for loop does.",
    "What is the difference between a list and a tuple in Python?", "How do I read a file in Python?",
    "Write a short poem about the moon.", "Write a short story about a brave mouse.",
    "Write a limerick about a cat.", "Describe a sunset over the mountains.",
    "Write a letter to a friend about a summer trip.", "Tell me a story about a dragon who loves books.",
    "List five fruits and their colors.", "Give me three tips for better sleep.",
    "List the planets of the solar system in order.", "Name five animals that live in the desert.",
    "Give me a simple recipe for tomato soup.", "What are the benefits of regular exercise?",
    "How can I save money on groceries?", "Give me four ideas for a rainy day at home.",
    "What should I pack for a beach holiday?", "How do I make a cup of tea?",
    "Rewrite this sentence more politely: Give me the report now.",
    "Summarize the story of Cinderella in three sentences.", "Translate 'good morning' into French and Spanish.",
    "Correct the grammar: She don't like apples.", "Explain the rules of chess briefly.",
    "What is the Pythagorean theorem?", "How do you calculate the area of a circle?",
    "What is the difference between a virus and a bacterium?", "Why do we need to drink water?",
    "What is democracy?", "Who invented the telephone?", "What was the Renaissance?",
    "Describe the city of Paris.", "What is the longest river in the world?",
    "How are mountains formed?", "What is renewable energy?", "How does a bicycle work?",
    "What is the role of the brain?", "Explain what inflation means.", "What is a good way to learn a new language?",
    "Describe your ideal weekend.", "What is friendship?", "How do birds know where to migrate?",
    "What do pandas eat?", "Why is the sun hot?",
)

TEMPLATES: tuple[str, ...] = (
    "Explain {} to a ten-year-old.", "What are three interesting facts about {}?",
    "Write a short paragraph about {}.", "Write a short poem about {}.", "What are the pros and cons of {}?",
    "Describe {} in a few sentences.", "Tell me a short story that involves {}.",
    "List five things people should know about {}.", "Summarize the history of {} briefly.",
    "Why is {} important?", "Write a friendly email to a colleague about {}.",
    "Give me a quiz question about {} and its answer.", "What are common misconceptions about {}?",
    "How would you teach a beginner about {}?", "Compare {} with something similar.",
    "Write a product description inspired by {}.", "What questions do children ask about {}?",
    "Give me a step-by-step guide related to {}.", "Write a dialogue between two friends about {}.",
    "What is the future of {}?",
)
SUBJECTS: tuple[str, ...] = (
    "volcanoes", "honeybees", "the harvest moon", "coffee", "electric cars", "the Roman Empire", "recycling", "dinosaurs",
    "the piano", "rain forests", "the human eye", "glaciers", "chocolate", "the printing press", "solar panels",
    "sharks", "the Olympic Games", "libraries", "bread baking", "sleep", "the stock market", "penguins",
    "the Great Wall of China", "gardening", "bicycles", "the water cycle", "spiders", "jazz music", "assembly lines",
    "the Eiffel Tower", "friendship", "time management", "tea", "ancient Egypt", "wind turbines", "owls", "soccer",
    "the immune system", "deserts", "trains", "origami", "photography", "the metric system", "whales",
    "public transport", "cheese", "the solar system", "castles", "video games", "mushrooms", "lightning",
    "the alphabet", "bridges", "kindness", "museums", "rivers", "the violin", "elephants", "space travel",
    "coral reefs", "mathematics", "pirates", "the Internet of Things", "yoga", "the desert tortoise",
    "cloud computing", "fire safety", "maps", "the French Revolution", "tomatoes", "hiking", "the ocean tides",
    "chess openings", "snow", "the printing of money", "ants", "wolves", "the Arctic", "classical music",
    "budgeting", "public speaking", "the telescope",
)
TEMPLATED_PROMPTS: tuple[str, ...] = tuple(t.format(s) for s in SUBJECTS for t in TEMPLATES)

# what `baton train-draft` generates from by default: the written prompts first, then the templated ones
ALL_TRAIN_PROMPTS: tuple[str, ...] = TRAIN_PROMPTS + TEMPLATED_PROMPTS

# held out from training: `baton train-draft` reports the acceptance length it reaches on these
EVAL_PROMPTS: tuple[str, ...] = (
    "What is the capital of France?", "Write a haiku about the sea.", "Explain why the sky is blue.",
    "How do airplanes fly?", "Give me a recipe for pancakes.", "What is machine learning?",
    "Why do we have seasons?", "Tell me a short story about a robot.",
)
