"""Meet users in the stack they already run: Hugging Face Trainer, Accelerate, Lightning."""
