"""S3 (and S3-compatible: MinIO, R2, Ceph) storage for checkpoints and run files.

Every transfer is verified against the local bytes, because a checkpoint that silently differs from what
was trained is worse than none. Credentials come from the usual AWS chain (env, profile, instance role);
nothing here reads or stores them. The modules: `client` (settings, URIs, the boto3 client), `errors`
(one classified, secret-free error per failure), `digest` (the checksums S3 will report) and `store`
(verified upload, download cache, delete).
"""
