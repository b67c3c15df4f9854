"""Planning: an attention call (problem.py) mapped onto kernel launches, pure data. Kernel families
(portable.py, v3.py) behind dispatch.py; head-dim padding around them."""
