"""Images and audio in prompts: decoding and checking media, the model's processor, the items a request carries."""
