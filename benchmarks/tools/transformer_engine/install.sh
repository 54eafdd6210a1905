#!/bin/bash
# On the GPU machine, from the repo root: TE from .te/ into /tmp/site, and /tmp/site/te_env.sh
# to source before running (PYTHONPATH=/tmp/site also needed).
TE=$PWD/.te
mkdir -p /tmp/site
[ -f /tmp/site/transformer_engine/wheel_lib/libtransformer_engine.so ] || \
  python3 -c "import tarfile; tarfile.open('$TE/te_tree.tar.xz').extractall('/tmp/site')"
for w in "$TE"/*.whl; do
  python3 -c "import zipfile, sys; zipfile.ZipFile(sys.argv[1]).extractall('/tmp/site')" "$w"
done
# cuDNN's sub-libraries are opened by soname: the pip cuDNN that JAX loads goes first on the
# library path, and TE is pointed at it (CUDNN_HOME), or TE loads another cuDNN and cuDNN
# fails with CUDNN_STATUS_SUBLIBRARY_LOADING_FAILED (TE then quietly takes its unfused path).
d=$(python3 -c "import glob, site, os
r = site.getsitepackages()[0] + '/nvidia'
cudnn = sorted(glob.glob(r + '/**/libcudnn_graph.so.9', recursive=True))
libs = sorted({os.path.dirname(p) for p in glob.glob(r + '/**/lib*.so*', recursive=True)})
print(':'.join([os.path.dirname(cudnn[0])] + libs))")
echo "export LD_LIBRARY_PATH=$d:\$LD_LIBRARY_PATH" > /tmp/site/te_env.sh
echo "export CUDNN_HOME=${d%%:*}" >> /tmp/site/te_env.sh
