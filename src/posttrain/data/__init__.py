"""The data every layer shares, importing nothing above it: token segments and chat messages
(`segments`, a leaf), OpenAI choices turned into segments (`openai_choices`), trajectories and
their groups (`trajectories`), DPO's
preference pairs (`preferences`), the checks on values that arrive from outside the type
system (`checks`), and the rows of dataset files in every format the jobs read (`rows`). Tinker's datum types are in `posttrain.types`.
"""
