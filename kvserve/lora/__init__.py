"""Multi-LoRA serving: adapter requests, PEFT loading, device slots, the batched LoRA linear."""
