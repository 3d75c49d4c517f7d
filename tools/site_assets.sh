#!/usr/bin/env bash
# Install the JavaScript the rendered book serves itself (MathJax, require.js and the
# ipywidgets renderer) from npm, at the versions locked in site/package-lock.json, and copy
# the parts the site needs into _build/site-assets. Sphinx copies that folder into the site's
# _static/, so math and widgets render with no internet. These are third-party files: they are
# installed at build time and never committed.
set -euo pipefail
cd "$(dirname "$0")/.."

npm ci --prefix site --no-audit --no-fund --ignore-scripts --loglevel=error

out=_build/site-assets
modules=site/node_modules
rm -rf "$out"
mkdir -p "$out/mathjax/input/tex" "$out/mathjax/output/chtml/fonts" "$out/widgets"

# MathJax: the TeX-to-HTML component, the TeX extensions it loads on demand, its fonts, and the
# menu and accessibility pieces it loads lazily (the speech engine, 4 MB, is left out).
mathjax=$modules/mathjax/es5
cp "$mathjax/tex-chtml.js" "$out/mathjax/"
cp -r "$mathjax/input/tex/extensions" "$out/mathjax/input/tex/"
cp -r "$mathjax/output/chtml/fonts/woff-v2" "$out/mathjax/output/chtml/fonts/"
cp -r "$mathjax/a11y" "$mathjax/ui" "$out/mathjax/"
cp "$modules/mathjax/LICENSE" "$out/mathjax/"

# require.js and the widget manager's AMD bundle (with the web fonts its CSS names).
cp "$modules/requirejs/require.js" "$out/"
widgets=$modules/@jupyter-widgets/html-manager/dist
cp "$widgets/embed-amd.js" "$out/widgets/"
cp "$widgets"/*.woff2 "$widgets"/*.woff "$out/widgets/"

du -sh "$out" | awk '{print "site assets: " $1 " in '"$out"'"}'
