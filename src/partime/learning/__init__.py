"""What a stage can do about learning from late gradients: delay compensation, and compensation that reads the optimizer's state.

Everything here is internal to partime unless ``partime`` exports it.
"""
