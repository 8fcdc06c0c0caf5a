"""The data every layer shares, importing nothing above it: trajectories and their token
segments (`trajectories`), OpenAI choices turned into segments (`openai_choices`) and DPO's
preference pairs (`preferences`). Tinker's datum types are in `posttrain.types`.
"""
