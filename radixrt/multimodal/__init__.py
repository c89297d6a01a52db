"""Inputs other than text. `images`: what a request carries (a data: URL, base64, bytes, an
allowed remote URL) made a decoded RGB picture and its content key, every bound checked before
anything is decoded. `processors`: a decoded picture made the pixel values a vision tower takes,
as transformers' image processors compute them. Nothing is imported here, and neither loads
torch: the HTTP gateway decodes images."""
