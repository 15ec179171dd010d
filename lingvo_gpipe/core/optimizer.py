"""Optimizers (Lingvo names), written natively: no tf.keras, no tf.compat.v1.

Each optimizer is configured by its Params and applies updates with

  opt = optimizer.Adam.Params().Set(beta1=0.9).Instantiate()
  opt.CreateSlots(variables)          # eagerly, before any tf.function
  opt.Apply(lr, [(grad, var), ...])   # returns the grouped update op

Slot variables are named `<variable name>/<slot>` (e.g.
`mlp/fc0/w/m`), so their names depend only on the model's variable names,
never on devices or pipeline splits, and each slot is created on its
variable's device. Step counters (Adam's and Adafactor's) are named
`<optimizer name>/iterations`. `slots()` returns {name: variable} of all of
them for checkpointing. `Apply` creates a missing slot under `tf.init_scope`
(so even inside a `tf.function` trace it is created once, eagerly), but
creating them up front with `CreateSlots` is preferred. Each variable's
update waits for its gradient, so its temporaries (Adam's beta1 * m and
beta2 * v, each the size of the variable) are made only once the step's
activations are spent, not held through the whole step.

The update rules are those of TF1's optimizers that Lingvo wraps:
  SGD       var -= lr * g
  Momentum  accum = alpha * accum + g;  var -= lr * accum
            (nesterov: var -= lr * (g + alpha * accum))
  RMSProp   ms = decay * ms + (1 - decay) * g^2   (ms starts at 1, as in TF1)
            mom = momentum * mom + lr * g / sqrt(ms + epsilon); var -= mom
  Adam      lr_t = lr * sqrt(1 - beta2^t) / (1 - beta1^t)
            m = beta1 m + (1 - beta1) g; v = beta2 v + (1 - beta2) g^2
            var -= lr_t * m / (sqrt(v) + epsilon)
  Adafactor Shazeer & Stern (2018), as tensor2tensor / Lingvo implement it.

`Base` (slots, counters, `Apply`) is in `optimizer_base.py`.
"""

import tensorflow as tf

from lingvo_gpipe.core import optimizer_base

__all__ = ['Base', 'SGD', 'Momentum', 'RMSProp', 'Adam', 'Adafactor', 'VarName']

Base = optimizer_base.Base
VarName = optimizer_base.VarName


class SGD(Base):
  """Plain gradient descent: var -= lr * grad."""

  def _Update(self, var, grad, lr, step):
    del step
    return var.assign_sub(lr * grad)


class Momentum(Base):
  """Momentum (TF1 MomentumOptimizer); slot `momentum`."""

  _SLOTS = {'momentum': 0.0}

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define(
      'alpha',
      0.9,
      "Momentum coefficient (Lingvo's name): the decay "
      'of the accumulated gradients.',
    )
    p.Define('use_nesterov', False, 'Whether to use Nesterov momentum.')
    return p

  def _Validate(self, p):
    if not 0.0 <= p.alpha < 1.0:
      raise self._Error(f'alpha = {p.alpha!r}', 'use 0 <= alpha < 1, e.g. 0.9.')

  def _Update(self, var, grad, lr, step):
    del step
    p = self.params
    alpha = self._Const(p.alpha, var.dtype.base_dtype)
    accum = self.GetSlot(var, 'momentum')
    new_accum = alpha * accum + grad
    a = accum.assign(new_accum)
    if p.use_nesterov:
      delta = lr * (grad + alpha * new_accum)
    else:
      delta = lr * new_accum
    with tf.control_dependencies([a]):
      return var.assign_sub(delta)


class RMSProp(Base):
  """RMSProp as TF1's RMSPropOptimizer (used by AmoebaNet); slots `rms`,
  `momentum` (and `mg` if centered)."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('decay', 0.9, 'Discount of the mean squared gradient.')
    p.Define('momentum', 0.0, 'Momentum of the update.')
    p.Define('epsilon', 1e-10, 'Added to the mean square inside the sqrt.')
    p.Define(
      'centered',
      False,
      'If True, normalize by the estimated variance of the gradient '
      '(mean square minus squared mean).',
    )
    return p

  def _Validate(self, p):
    if not 0.0 <= p.decay < 1.0 or not 0.0 <= p.momentum < 1.0:
      raise self._Error(
        f'decay = {p.decay!r}, momentum = {p.momentum!r}',
        'both must be in [0, 1).',
      )
    if p.epsilon <= 0:
      raise self._Error(f'epsilon = {p.epsilon!r}', 'it must be > 0.')

  def _SlotSpecs(self, var):
    shape = var.shape.as_list()
    specs = [('rms', shape, 1.0), ('momentum', shape, 0.0)]
    if self.params.centered:
      specs.append(('mg', shape, 0.0))
    return specs

  def _Update(self, var, grad, lr, step):
    del step
    p = self.params
    dtype = var.dtype.base_dtype
    decay = self._Const(p.decay, dtype)
    rest = self._Const(1.0 - p.decay, dtype)
    ms = self.GetSlot(var, 'rms')
    mom = self.GetSlot(var, 'momentum')
    new_ms = decay * ms + rest * tf.square(grad)
    ops = [ms.assign(new_ms)]
    denom = new_ms
    if p.centered:
      mg = self.GetSlot(var, 'mg')
      new_mg = decay * mg + rest * grad
      ops.append(mg.assign(new_mg))
      denom = new_ms - tf.square(new_mg)
    new_mom = self._Const(p.momentum, dtype) * mom + lr * grad / tf.sqrt(
      denom + self._Const(p.epsilon, dtype)
    )
    ops.append(mom.assign(new_mom))
    with tf.control_dependencies(ops):
      return var.assign_sub(new_mom)


class Adam(Base):
  """Adam (TF1 AdamOptimizer); slots `m`, `v` and the `iterations` counter."""

  _SLOTS = {'m': 0.0, 'v': 0.0}
  _HAS_COUNTER = True

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('beta1', 0.9, 'Decay of the first moment.')
    p.Define('beta2', 0.999, 'Decay of the second moment.')
    p.Define('epsilon', 1e-6, "Added to sqrt(v) (Lingvo's default 1e-6).")
    return p

  def _Validate(self, p):
    if not (0.0 <= p.beta1 < 1.0 and 0.0 <= p.beta2 < 1.0):
      raise self._Error(
        f'beta1 = {p.beta1!r}, beta2 = {p.beta2!r}', 'both must be in [0, 1).'
      )
    if p.epsilon <= 0:
      raise self._Error(f'epsilon = {p.epsilon!r}', 'it must be > 0.')

  def _Update(self, var, grad, lr, step):
    p = self.params
    dtype = var.dtype.base_dtype
    one = self._Const(1.0, dtype)
    beta1, beta2 = self._Const(p.beta1, dtype), self._Const(p.beta2, dtype)
    m = self.GetSlot(var, 'm')
    v = self.GetSlot(var, 'v')

    def LearningRate():
      t = tf.cast(step, dtype)
      return lr * tf.sqrt(one - tf.pow(beta2, t)) / (one - tf.pow(beta1, t))

    lr_t = self._Shared('adam_lr', LearningRate, var)
    new_m = beta1 * m + self._Const(1.0 - p.beta1, dtype) * grad
    new_v = beta2 * v + self._Const(1.0 - p.beta2, dtype) * tf.square(grad)
    ops = [m.assign(new_m), v.assign(new_v)]
    with tf.control_dependencies(ops):
      return var.assign_sub(
        lr_t * new_m / (tf.sqrt(new_v) + self._Const(p.epsilon, dtype))
      )


def _Rms(x):
  """The root mean square of x (its axes a shared constant, `Base._Const`)."""
  axes = Base._Const(list(range(x.shape.rank)), tf.int32)
  return tf.sqrt(tf.reduce_mean(tf.square(x), axes))


class Adafactor(Base):
  """Adafactor (Shazeer & Stern, 2018) as in tensor2tensor and Lingvo.

  Variables of rank >= 2 whose last two dims are both >= min_dim_size_to_factor
  keep factored second moments: `vr` (row means, shape[:-1]) and `vc`
  (column means, shape[:-2] + shape[-1:]); others keep a full `v`. With
  beta1 > 0 there is also a momentum slot `m`. Per step t (1-based):

    decay = 1 - t^-decay_exponent_pow        (or beta2 if decay_exponent_pow
                                              is None)
    g2 = g^2 + epsilon1
    factored:  vr = decay vr + (1-decay) mean(g2, -1)
               vc = decay vc + (1-decay) mean(g2, -2)
               u = g * rsqrt(vr / mean(vr, -1))[..., None]
                     * rsqrt(vc)[..., None, :]
    else:      v = decay v + (1-decay) g2;  u = g * rsqrt(v)
    u /= max(1, rms(u) / clipping_threshold)          (if clipping_threshold)
    u *= lr * (max(rms(var), epsilon2) if multiply_by_parameter_scale else 1)
    m = beta1 m + (1-beta1) u; u = m                  (if beta1 > 0)
    var -= u
  """

  _HAS_COUNTER = True

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('beta1', 0.0, 'Momentum of the update; 0: no momentum slot.')
    p.Define(
      'beta2',
      0.999,
      'Second-moment decay, used when decay_exponent_pow is None.',
    )
    p.Define(
      'decay_exponent_pow',
      0.8,
      'If set, the second-moment decay is 1 - t^-decay_exponent_pow.',
    )
    p.Define(
      'clipping_threshold',
      1.0,
      'Update clipping threshold (RMS of the update); None: off.',
    )
    p.Define('factored', True, 'Whether to factor the second moments.')
    p.Define(
      'min_dim_size_to_factor',
      128,
      'Factor only if the last two dims are at least this size '
      "(Lingvo's default).",
    )
    p.Define(
      'multiply_by_parameter_scale',
      False,
      'If True, scale the step by max(rms(var), epsilon2) (the '
      '"relative step"); False: the step is the learning rate.',
    )
    p.Define('epsilon1', 1e-30, 'Added to the squared gradients.')
    p.Define('epsilon2', 1e-3, 'Lower bound of the parameter scale.')
    return p

  def _Validate(self, p):
    if not 0.0 <= p.beta1 < 1.0:
      raise self._Error(f'beta1 = {p.beta1!r}', 'use 0 <= beta1 < 1.')
    if p.decay_exponent_pow is None and not 0.0 <= p.beta2 < 1.0:
      raise self._Error(f'beta2 = {p.beta2!r}', 'use 0 <= beta2 < 1.')
    if p.clipping_threshold is not None and p.clipping_threshold <= 0:
      raise self._Error(
        f'clipping_threshold = {p.clipping_threshold!r}',
        'use a positive value or None.',
      )

  def _Factored(self, shape):
    p = self.params
    return (
      p.factored
      and len(shape) >= 2
      and min(shape[-2:]) >= p.min_dim_size_to_factor
    )

  def _SlotSpecs(self, var):
    shape = var.shape.as_list()
    if self._Factored(shape):
      specs = [('vr', shape[:-1], 0.0), ('vc', shape[:-2] + shape[-1:], 0.0)]
    else:
      specs = [('v', shape, 0.0)]
    if self.params.beta1:
      specs.append(('m', shape, 0.0))
    return specs

  def _Update(self, var, grad, lr, step):
    p = self.params
    dtype = var.dtype.base_dtype
    t = tf.cast(step, dtype)
    one = self._Const(1.0, dtype)
    if p.decay_exponent_pow is not None:
      decay = one - tf.pow(t, self._Const(-p.decay_exponent_pow, dtype))
    else:
      decay = self._Const(p.beta2, dtype)
    g2 = tf.square(grad) + self._Const(p.epsilon1, dtype)
    ops = []
    if self._Factored(var.shape.as_list()):
      vr, vc = self.GetSlot(var, 'vr'), self.GetSlot(var, 'vc')
      last, second_last = (self._Const(a, tf.int32) for a in (-1, -2))
      new_vr = decay * vr + (one - decay) * tf.reduce_mean(g2, last)
      new_vc = decay * vc + (one - decay) * tf.reduce_mean(g2, second_last)
      ops += [vr.assign(new_vr), vc.assign(new_vc)]
      r_factor = tf.math.rsqrt(
        new_vr / tf.reduce_mean(new_vr, last, keepdims=True)
      )
      c_factor = tf.math.rsqrt(new_vc)
      u = (
        grad
        * tf.expand_dims(r_factor, last)
        * tf.expand_dims(c_factor, second_last)
      )
    else:
      v = self.GetSlot(var, 'v')
      new_v = decay * v + (one - decay) * g2
      ops.append(v.assign(new_v))
      u = grad * tf.math.rsqrt(new_v)
    if p.clipping_threshold is not None:
      u /= tf.maximum(one, _Rms(u) / self._Const(p.clipping_threshold, dtype))
    scale = lr
    if p.multiply_by_parameter_scale:
      scale *= tf.maximum(_Rms(var), self._Const(p.epsilon2, dtype))
    u *= scale
    if p.beta1:
      m = self.GetSlot(var, 'm')
      u = (
        self._Const(p.beta1, dtype) * m + self._Const(1.0 - p.beta1, dtype) * u
      )
      ops.append(m.assign(u))
    with tf.control_dependencies(ops):
      return var.assign_sub(u)
