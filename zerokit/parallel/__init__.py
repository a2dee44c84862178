"""Who works with whom beyond data parallelism: the job's mesh (mesh.py: pipeline x data x tensor ranks) and
tensor parallelism (tensor/)."""
