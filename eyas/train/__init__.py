"""EAGLE draft training: online distillation from a frozen target (`trainer`), data handling (`data`), the loss
(`loss`), and regeneration of assistant turns by the target itself (`distill_data`)."""
