"""The multilingual Transformer of the GPipe paper (layers, task, decoding).

layers    the flat layer list a PipeliningLayer splits into cells
model     TransformerMTTask: loss, Decode, per-language BLEU
decoding  greedy and beam search with length normalization
bleu      sacrebleu BLEU per language
"""
