"""Building blocks of the model code: paged attention, the linear method (each weight's form and
kernel), RMSNorm, rotary embedding, the vocabulary-parallel head, the batched LoRA op and
token-bitmask masking."""
